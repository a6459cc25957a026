"""CPU: each kernel variant is its own NVRTC program (``fallback_kernels._loader``).

A first launch compiles only the kernel it asks for, and the disk cache keeps one entry per
variant and arch, so a later process reads back exactly the kernels it launches. NVRTC runs here
for real (no GPU needed); only the last step of ``get_function``, loading the cubin into a CUDA
context, is replaced by a recording stand-in for CuPy's ``Module``.
"""

from __future__ import annotations

import contextlib
import types

import pytest

pytest.importorskip("cupy")

import cupy
import torch
from cupy.cuda import driver, nvrtc

from cudnn_attn.core.caches import clear_caches
from cudnn_attn.fallback_kernels import _loader, cubin_cache
from cudnn_attn.fallback_kernels import fused as F
from cudnn_attn.fallback_kernels import unfused as U

ARCH = "sm_80"


@pytest.fixture
def nvrtc_calls(tmp_path, monkeypatch):
    """An empty cubin cache and process memo; the name expressions of every program NVRTC
    compiles, one tuple per program."""
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(tmp_path / "cubins"))
    clear_caches()
    programs: dict[int, list[str]] = {}
    compiled: list[tuple[str, ...]] = []
    real_add, real_compile = nvrtc.addNameExpression, nvrtc.compileProgram

    def add(prog, expression):
        programs.setdefault(prog, []).append(expression)
        return real_add(prog, expression)

    def compile_(prog, options):
        compiled.append(tuple(programs.pop(prog, [])))
        return real_compile(prog, options)

    monkeypatch.setattr(nvrtc, "addNameExpression", add)
    monkeypatch.setattr(nvrtc, "compileProgram", compile_)
    yield compiled
    clear_caches()


class RecordingModule:
    """Stands in for ``cupy.cuda.function.Module`` (loading a cubin needs a GPU)."""

    loaded: list[tuple[bytes, str]] = []

    def load(self, cubin):
        self.cubin = bytes(cubin)

    def get_function(self, name):
        RecordingModule.loaded.append((self.cubin, name))
        return types.SimpleNamespace(name=name, ptr=0)


@pytest.fixture
def no_gpu_load(monkeypatch):
    RecordingModule.loaded = []
    monkeypatch.setattr(cupy.cuda.function, "Module", RecordingModule)
    monkeypatch.setattr(cupy.cuda, "Device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_loader, "device_arch", lambda index: ARCH)
    return RecordingModule.loaded


def test_get_function_compiles_only_the_variant_asked_for(nvrtc_calls, no_gpu_load):
    gather = "na_neighbor_gather<float>"
    fn = _loader.get_function(U.SOURCE, U.DEFINES, gather, 0)
    assert nvrtc_calls == [(gather,)]  # one program, holding one kernel out of 16
    ((cubin, name),) = no_gpu_load
    assert cubin[:4] == b"\x7fELF" and fn.name == name
    assert name == _loader.compile_program(U.SOURCE, U.DEFINES, [gather], ARCH).lowered[gather]
    # The same kernel again (same or another device index): nothing compiles.
    _loader.get_function(U.SOURCE, U.DEFINES, gather, 0)
    _loader.get_function(U.SOURCE, U.DEFINES, gather, 1)
    assert nvrtc_calls == [(gather,)]
    # Another kernel of the same source: its own program, only it.
    _loader.get_function(U.SOURCE, U.DEFINES, "na_neighbor_dot<double>", 0)
    assert nvrtc_calls == [(gather,), ("na_neighbor_dot<double>",)]


def test_a_first_fused_call_compiles_one_kernel(nvrtc_calls, no_gpu_load, monkeypatch):
    """The fused launcher's kernel lookup (a first fp16 2-D call's forward on an sm_80 device:
    the pipelined build) compiles the forward at head dim 64 and nothing else."""
    monkeypatch.setattr(driver, "funcSetAttribute", lambda *args: None)
    F._function("na_fused_forward", torch.float16, 64, 0, True)
    assert nvrtc_calls == [("na_fused_forward<na_half, 64>",)]
    assert len(F.pipelined_variants()) == 24  # what one program of the build would compile


def test_each_variant_has_its_own_disk_entry(nvrtc_calls, tmp_path):
    variants = U.variants()[:3]
    for variant in variants:
        build = _loader.compile_variant(variant, U.DEFINES, ARCH)
        assert build.origin == "compiled" and build.record.kernel == variant.kernel
    entries = sorted((tmp_path / "cubins").glob("*" + cubin_cache.SUFFIX))
    text = _loader.source_text(U.SOURCE, U.DEFINES)
    version = cubin_cache.nvrtc_version()
    keys = {cubin_cache.program_key(text, (v.expression,), ARCH, _loader.NVRTC_OPTIONS, version)
            for v in variants}
    assert len(keys) == 3 and {e.name[:-len(cubin_cache.SUFFIX)] for e in entries} == keys
    assert len(nvrtc_calls) == 3
    # A new process (memo emptied) launching the second kernel reads its entry alone.
    clear_caches()
    hits = cubin_cache.info()["hits"]
    again = _loader.compile_variant(variants[1], U.DEFINES, ARCH)
    assert again.origin == "disk" and cubin_cache.info()["hits"] == hits + 1
    assert len(nvrtc_calls) == 3
    assert _loader.compile_variant(variants[1], U.DEFINES, ARCH).origin == "memory"
