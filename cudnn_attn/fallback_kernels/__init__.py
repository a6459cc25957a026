"""CuPy RawKernels for the masks cuDNN cannot express (neighborhood attention first).

The CUDA C lives in ``*.cu`` files shipped as package data; ``_loader`` compiles them with NVRTC,
``launch`` hands torch tensors to them (DLPack, torch's current stream, device tables), ``limits``
declares what they can run: ``kernel_reasons(device)`` says why they cannot run on a device (empty
when they can); ``FUSED_DTYPES`` and ``valid_tile_sizes``/``check_tile_sizes`` are what the fused
kernels take (NATTEN's op layer validates its arguments with them). ``fused`` and ``unfused`` launch them; ``backend`` is the ``"cupy"`` engine.
``compile_all(arch)`` compiles every kernel variant the package can launch for one architecture
and reports registers and spills; it needs the NVRTC library but no GPU::

    >>> from cudnn_attn import fallback_kernels
    >>> records = fallback_kernels.compile_all("sm_90")
    >>> records[0]["kernel"], records[0]["spill_stores"]      # doctest: +SKIP
    ('fused_forward[float,d32]', 0)
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from ._loader import CompileRecord, KernelCompileError, compile_program, compile_records
from .limits import FUSED_DTYPES, LIMITS, kernel_reasons
from .tile_shapes import check_tile_sizes, valid_tile_sizes

# Modules that launch kernels; each exposes SOURCE, DEFINES and variants() (and MIN_ARCH, the
# oldest sm it compiles for, when it has one).
KERNEL_MODULES = ("fused", "fused_pipelined", "unfused")

__all__ = ["compile_all", "kernel_programs", "kernel_variants", "kernel_reasons", "LIMITS",
           "CompileRecord", "KernelCompileError", "FUSED_DTYPES", "valid_tile_sizes",
           "check_tile_sizes"]


def kernel_variants() -> dict:
    """module name -> the list of KernelVariant it can launch."""
    found = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        found[name] = list(module.variants())
    return found


def kernel_programs(arch: str) -> dict:
    """module name -> its kernel variants, for the modules that compile for ``arch`` (one NVRTC
    program each)."""
    number = int("".join(ch for ch in arch.split("_", 1)[1] if ch.isdigit()) or 0)
    return {name: variants for name, variants in kernel_variants().items()
            if number >= getattr(importlib.import_module(f"{__name__}.{name}"), "MIN_ARCH", 0)}


def compile_all(arch: str, programs: Sequence[str] | None = None) -> list[CompileRecord]:
    """Compile every kernel variant for ``arch`` ("sm_80", "sm_90", ...) with NVRTC.

    ``programs``: only these modules' kernels (names of ``kernel_programs(arch)``; default all).
    Returns one record per kernel with the fields ``kernel``, ``arch``, ``registers``,
    ``spill_stores``, ``spill_loads`` (and ``stack_bytes``, ``expression``); records index like
    dicts too. Raises ``KernelCompileError`` with NVRTC's log if a source does not compile, and
    ``ImportError`` naming the package if CuPy/NVRTC are missing.
    """
    if not isinstance(arch, str) or not arch.startswith(("sm_", "compute_")):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    try:
        from cupy.cuda import nvrtc  # noqa: F401
    except ImportError as exc:
        raise ImportError("compile_all needs CuPy and NVRTC: pip install 'cudnn-attn[cu12]' "
                          f"({exc})") from None
    records: list[CompileRecord] = []
    for name, variants in kernel_programs(arch).items():
        if programs is not None and name not in programs:
            continue
        module = importlib.import_module(f"{__name__}.{name}")
        program = compile_program(module.SOURCE, module.DEFINES,
                                  [v.expression for v in variants], arch)
        records += compile_records(program, variants)
    return records
