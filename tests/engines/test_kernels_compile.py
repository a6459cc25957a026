"""Every CUDA kernel the package can launch compiles with NVRTC for sm_80 and sm_90, without spills.

No GPU is needed: NVRTC (the nvidia-cuda-nvrtc wheel, loaded through CuPy) compiles to a cubin and
``ptxas -v`` reports registers and spills. These tests are the CPU suite's proof that the kernels
exist as shipped and fit their register budgets; whether they compute the right values is the
job of the GPU-marked tests.
"""

import re
import time

import pytest

from cudnn_attn import fallback_kernels
from cudnn_attn.fallback_kernels import _loader

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module", params=ARCHS)
def records(request):
    # On the tools' thread count: the records a serial build gives (test_compile_all_reports_each_
    # kernel_in_order_whatever_the_threads checks that), in half the time on 2 cores.
    return fallback_kernels.compile_all(request.param, jobs=fallback_kernels.default_jobs())


def test_every_variant_compiles_with_a_record(records):
    arch = records[0]["arch"]
    # Every module compiling for the arch (the wide forward is sm_90+ only).
    variants = [v for vs in fallback_kernels.kernel_programs(arch).values() for v in vs]
    assert len(records) == len(variants)
    for wide in ("na_fused_forward_wide<", "na_fused_backward_dq_wide<",
                 "na_fused_forward_wgmma<", "na_fused_forward_wide_wgmma<"):
        assert any(r.kernel.startswith(wide) for r in records) == (arch == "sm_90")
    assert {r.kernel for r in records} == {v.kernel for v in variants}
    for record in records:
        # The wgmma forward compiles for the arch-specific target (sm_90a).
        assert record["arch"] == (f"{arch}a" if "wgmma" in record.kernel else arch)
        assert 0 < record["registers"] <= 255, record


def test_wgmma_kernels_are_not_serialized(records):
    """ptxas serializes wgmma (C7515) or injects waits (C7517) when registers a wgmma in flight
    uses are touched before its wait; it says so in its log (a kernel reading the accumulators
    before the wait shows both)."""
    from cudnn_attn.fallback_kernels import fused_hopper as H

    if records[0]["arch"] != "sm_90":
        assert not any("wgmma" in r.kernel for r in records)
        return
    for variant in H.variants():  # memoized by compile_all: compiles nothing more
        program = _loader.compile_program(H.SOURCE, H.DEFINES, [variant.expression], "sm_90a")
        assert program.cubin[:4] == b"\x7fELF"
        assert "C7515" not in program.log and "C7517" not in program.log, program.log


def test_no_variant_spills(records):
    spilling = [(r.kernel, r.arch, r.spill_stores, r.spill_loads) for r in records
                if r.spill_stores or r.spill_loads]
    assert spilling == []


def test_fused_kernels_cover_every_dtype_and_direction():
    kernels = {v.kernel for v in fallback_kernels.kernel_variants()["fused"]}
    text = " ".join(sorted(kernels))
    for dtype in ("float", "half", "bf16"):
        assert dtype in text
    for direction in ("forward", "dq", "dkdv"):
        assert direction in text


def test_unfused_kernels_include_double():
    expressions = [v.expression for v in fallback_kernels.kernel_variants()["unfused"]]
    assert any("double" in e for e in expressions)


def test_half_kernels_use_tensor_cores(records):
    # mma.sync must be in the fp16/bf16 fused forward; fp32 must not silently use tf32.
    module = __import__("cudnn_attn.fallback_kernels.fused", fromlist=["SOURCE"])
    # The program compile_all built for this variant (memoized: compiles nothing more).
    program = _loader.compile_program(module.SOURCE, module.DEFINES,
                                      ["na_fused_forward<na_half, 64>"], records[0].arch)
    text = _loader.source_text(module.SOURCE, module.DEFINES)
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", text)
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", text)
    assert not re.search(r"mma[^\n]*tf32", text)
    assert program.cubin[:4] == b"\x7fELF"


def test_ptxas_log_parsing_is_exact():
    log = (
        "ptxas info    : Compiling entry function '_Z1kIfEvPT_' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kIfEvPT_\n"
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 380 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function '_Z1kIdEvPT_' for 'sm_90'\n"
        "ptxas info    : Used 12 registers, used 0 barriers\n"
    )
    usage = _loader.ptxas_usage(log)
    assert usage["_Z1kIfEvPT_"] == {"stack_bytes": 16, "spill_stores": 8, "spill_loads": 4,
                                    "registers": 40}
    assert usage["_Z1kIdEvPT_"] == {"registers": 12}


def test_sources_are_prefixed_by_defines_and_common():
    text = _loader.source_text("unfused.cu", {"NA_TEST_VALUE": 7})
    assert text.startswith("#define NA_TEST_VALUE 7\n")
    assert text.index("struct NaAxis") < text.index('#line 1 "unfused.cu"')


def test_compile_errors_carry_the_nvrtc_log(tmp_path, monkeypatch):
    original = _loader._read
    monkeypatch.setattr(_loader, "_read", lambda name: "this is not C++;" if name == "bad.cu"
                        else original(name))
    with pytest.raises(_loader.KernelCompileError, match="bad.cu"):
        _loader.compile_program("bad.cu", {}, [], "sm_90")


def test_compile_all_rejects_a_bad_arch():
    with pytest.raises(ValueError, match="arch"):
        fallback_kernels.compile_all("hopper")


def test_cli_kernels_prints_every_record_and_a_line_per_kernel(capsys):
    import json

    from cudnn_attn.cli import main

    assert main(["kernels", "--arch", "sm_90", "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    expected = fallback_kernels.compile_all("sm_90")
    assert printed == [{k: r[k] for k in r.keys()} for r in expected]
    assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in printed)
    # stderr: one progress line per kernel, counted in order, naming the kernel.
    lines = [line for line in captured.err.splitlines() if line.startswith("kernels [")]
    assert len(lines) == len(expected)
    for done, (line, record) in enumerate(zip(lines, expected), 1):
        assert re.fullmatch(rf"kernels \[{done}/{len(expected)}\] sm_90 {re.escape(record.kernel)} "
                            r"\d+\.\d s( \((memory|disk)\))?", line), line


def test_compile_all_reports_each_kernel_in_order_whatever_the_threads():
    unfused = fallback_kernels.kernel_programs("sm_80")["unfused"]
    seen = []
    serial = fallback_kernels.compile_all("sm_80", programs=["unfused"], jobs=1)
    threaded = fallback_kernels.compile_all(
        "sm_80", programs=["unfused"], jobs=3,
        progress=lambda done, total, build: seen.append((done, total, build.record.kernel,
                                                         build.origin)))
    assert [r.kernel for r in serial] == [v.kernel for v in unfused]
    assert threaded == serial
    assert [s[:3] for s in seen] == [(i, len(unfused), v.kernel)
                                     for i, v in enumerate(unfused, 1)]
    assert {s[3] for s in seen} == {"memory"}  # the serial pass built them in this process


def test_default_jobs_follow_the_cpus_up_to_a_cap(monkeypatch):
    import os

    for cpus, expected in ((1, 1), (2, 2), (64, fallback_kernels.MAX_DEFAULT_JOBS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)),
                            raising=False)
        assert fallback_kernels.default_jobs() == expected


def test_compile_all_rejects_bad_jobs():
    for jobs in (0, -1, 1.5, "2", None, True):
        with pytest.raises(ValueError, match="jobs"):
            fallback_kernels.compile_all("sm_80", jobs=jobs)


def test_a_failing_kernel_stops_compile_all(monkeypatch):
    real = fallback_kernels.compile_variant
    started = []

    def failing(variant, defines, arch):
        started.append(variant.kernel)
        if len(started) == 1:
            raise _loader.KernelCompileError(f"NVRTC could not compile {variant.kernel}")
        time.sleep(0.2)  # the others take a while, as compiles do
        return real(variant, defines, arch)

    monkeypatch.setattr(fallback_kernels, "compile_variant", failing)
    for jobs in (1, 2):
        started.clear()
        with pytest.raises(_loader.KernelCompileError, match="could not compile"):
            fallback_kernels.compile_all("sm_80", programs=["unfused"], jobs=jobs)
        # The kernels not yet started when the first failed are not compiled.
        assert len(started) <= jobs + 1 < len(fallback_kernels.kernel_programs("sm_80")["unfused"])
