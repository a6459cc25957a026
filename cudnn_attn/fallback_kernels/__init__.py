"""CuPy RawKernels for the masks cuDNN cannot express (neighborhood attention first).

The CUDA C lives in ``*.cu`` files shipped as package data; ``_loader`` compiles them with NVRTC,
``launch`` hands torch tensors to them (DLPack, torch's current stream, device tables), ``limits``
declares what they can run: ``kernel_reasons(device)`` says why they cannot run on a device (empty
when they can); ``FUSED_DTYPES`` and ``valid_tile_sizes``/``check_tile_sizes`` are what the fused
kernels take (NATTEN's op layer validates its arguments with them). ``fused`` and ``unfused`` launch them; ``backend`` is the ``"cupy"`` engine.
``compile_all(arch)`` compiles every kernel variant the package can launch for one architecture,
each its own NVRTC program (``jobs=`` at once on a thread pool), and reports registers and spills;
it needs the NVRTC library but no GPU::

    >>> from cudnn_attn import fallback_kernels
    >>> records = fallback_kernels.compile_all("sm_90")
    >>> records[0]["kernel"], records[0]["spill_stores"]      # doctest: +SKIP
    ('na_fused_forward<float,32>', 0)
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ._loader import (CompileRecord, KernelBuild, KernelCompileError, KernelVariant,
                      compile_variant)
from .limits import FUSED_DTYPES, LIMITS, kernel_reasons
from .tile_shapes import check_tile_sizes, valid_tile_sizes

# Modules that launch kernels; each exposes SOURCE, DEFINES and variants() (and MIN_ARCH, the
# oldest sm it compiles for, when it has one; TARGETS, when it compiles for some archs only, each
# into an arch-specific target: {"sm_90": "sm_90a"}).
KERNEL_MODULES = ("fused", "fused_pipelined", "fused_wide", "fused_hopper", "unfused")

__all__ = ["compile_all", "default_jobs", "kernel_programs", "kernel_variants", "kernel_reasons",
           "LIMITS", "CompileRecord", "KernelBuild", "KernelCompileError", "FUSED_DTYPES",
           "valid_tile_sizes", "check_tile_sizes"]


def kernel_variants() -> dict:
    """module name -> the list of KernelVariant it can launch."""
    found = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        found[name] = list(module.variants())
    return found


def kernel_programs(arch: str) -> dict:
    """module name -> its kernel variants, for the modules that compile for ``arch`` (each
    variant is one NVRTC program)."""
    number = int("".join(ch for ch in arch.split("_", 1)[1] if ch.isdigit()) or 0)
    return {name: variants for name, variants in kernel_variants().items()
            if _compiles_for(importlib.import_module(f"{__name__}.{name}"), arch, number)}


def _compiles_for(module, arch: str, number: int) -> bool:
    targets = getattr(module, "TARGETS", None)
    return number >= getattr(module, "MIN_ARCH", 0) and (targets is None or arch in targets)


def target_arch(module_name: str, arch: str) -> str:
    """The arch ``module_name``'s kernels are compiled for on an ``arch`` device."""
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, "TARGETS", {}).get(arch, arch)


MAX_DEFAULT_JOBS = 8  # one NVRTC compile of a fused kernel peaks near 0.4 GB


def default_jobs() -> int:
    """Threads the tools (``cudnn-attn kernels``, the GPU proof's prebuild) compile with: the
    CPUs this process may use, at most ``MAX_DEFAULT_JOBS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_JOBS))


Progress = Callable[[int, int, KernelBuild], None]


def compile_all(arch: str, programs: Sequence[str] | None = None,
                progress: Progress | None = None, jobs: int = 1) -> list[CompileRecord]:
    """Compile every kernel variant for ``arch`` ("sm_80", "sm_90", ...) with NVRTC.

    Each variant is its own NVRTC program, compiled (or read from the cubin cache) on ``jobs``
    threads (NVRTC runs without the GIL; ``default_jobs()`` is what the tools use, 1 the
    default here: a library call starts no threads unless asked). ``programs``: only these
    modules' kernels (names of ``kernel_programs(arch)``; default all). ``progress(done, total,
    build)`` is called once per kernel, in order, from the calling thread (``build``: a
    ``KernelBuild`` with the record, seconds and ``origin``). Returns one record per kernel, in
    the order of ``kernel_programs(arch)`` whatever ``jobs``, with the fields ``kernel``,
    ``arch``, ``registers``, ``spill_stores``, ``spill_loads`` (and ``stack_bytes``,
    ``expression``); records index like dicts too. Raises ``KernelCompileError`` with NVRTC's
    log if a source does not compile, and ``ImportError`` naming the package if CuPy/NVRTC are
    missing.
    """
    if not isinstance(arch, str) or not arch.startswith(("sm_", "compute_")):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    try:
        from cupy.cuda import nvrtc  # noqa: F401
    except ImportError as exc:
        raise ImportError("compile_all needs CuPy and NVRTC: pip install 'cudnn-attn[cu12]' "
                          f"({exc})") from None
    work: list[tuple[KernelVariant, dict, str]] = []
    for name, variants in kernel_programs(arch).items():
        if programs is None or name in programs:
            defines = importlib.import_module(f"{__name__}.{name}").DEFINES
            work += [(variant, defines, target_arch(name, arch)) for variant in variants]
    workers = min(jobs, max(len(work), 1))
    records: list[CompileRecord] = []

    def report(build: KernelBuild) -> None:
        records.append(build.record)
        if progress is not None:
            progress(len(records), len(work), build)

    if workers == 1:
        for variant, defines, target in work:
            report(compile_variant(variant, defines, target))
        return records
    with ThreadPoolExecutor(workers, thread_name_prefix="cudnn_attn-nvrtc") as pool:
        futures = [pool.submit(compile_variant, variant, defines, target)
                   for variant, defines, target in work]
        try:
            for future in futures:  # in submission order: the output does not depend on timing
                report(future.result())
        except BaseException:
            for future in futures:  # a failed compile (or Ctrl-C) stops what has not started
                future.cancel()
            raise
    return records
