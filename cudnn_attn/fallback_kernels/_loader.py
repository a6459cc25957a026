"""The one loader of the package's CUDA sources: read, prepend, compile with NVRTC, memoize.

A kernel file never sees an f-string: its text is the ``.cu`` file as shipped, preceded by a block
of ``#define`` lines (built from a dict owned by the Python module that launches it) and by
``common.cu``. Every template instance a module can launch is named by a :class:`KernelVariant`;
each variant is its own NVRTC program per architecture (the whole text, one name expression),
compiled to a cubin with ``ptxas -v`` so that register and spill counts come back with it. One
program per variant keeps a first launch cheap (``get_function`` compiles the one kernel it is
asked for, seconds, not the whole source's tens of seconds) and lets ``compile_all`` report, and
parallelise, kernel by kernel. Compiling needs only the NVRTC library (``nvidia-cuda-nvrtc-cu12``,
loaded through CuPy), never a GPU; loading a cubin needs one. Compiled programs are memoized per
process and kept on disk per machine (``cubin_cache``, one entry per variant and arch), so each
kernel is compiled once per machine, not once per run.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Mapping, Optional, Sequence

from ..core.caches import LRU, memoize
from . import cubin_cache, occupancy

COMMON_SOURCE = "common.cu"
NVRTC_OPTIONS = ("-std=c++17", "--ptxas-options=-v")


@dataclass(frozen=True)
class KernelVariant:
    """One launchable template instance.

    ``source`` is the ``.cu`` file, ``expression`` the C++ name expression NVRTC instantiates
    (``"na_fused_forward<na_half, 64>"``), ``kernel`` a short readable id for reports;
    ``threads`` (per CTA) and ``dynamic_smem_bytes`` are what its launches use (0: not
    declared), from which the compile record derives the occupancy.
    """

    source: str
    expression: str
    kernel: str
    threads: int = 0
    dynamic_smem_bytes: int = 0


@dataclass(frozen=True)
class CompiledProgram:
    source: str
    arch: str
    cubin: bytes
    lowered: Mapping[str, str]  # name expression -> mangled symbol
    log: str


@dataclass(frozen=True)
class CompileRecord:
    """What ``compile_all`` reports for one kernel (also readable as a dict).

    Registers, spills, stack and static shared memory come from ``ptxas -v`` (its log is kept
    with the cubin in the disk cache, so a warm cache reports them too); ``threads`` and
    ``dynamic_smem_bytes`` from the variant's launches; ``ctas_per_sm``, ``warps_per_sm`` and
    ``occupancy_limiter`` are the theoretical occupancy they give (``occupancy.py``; ``None``
    where the variant declares no block size)."""

    kernel: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    expression: str
    static_smem_bytes: int = 0
    dynamic_smem_bytes: int = 0
    threads: int = 0

    def __getitem__(self, name: str):
        return getattr(self, name)

    def keys(self):
        return ("kernel", "arch", "registers", "spill_stores", "spill_loads", "stack_bytes",
                "expression", "static_smem_bytes", "dynamic_smem_bytes", "threads",
                "ctas_per_sm", "warps_per_sm", "occupancy_limiter")

    def occupancy(self) -> Optional["occupancy.Occupancy"]:
        if self.threads < 1:
            return None
        return occupancy.occupancy(self.arch, registers=self.registers, threads=self.threads,
                                   static_shared=self.static_smem_bytes,
                                   dynamic_shared=self.dynamic_smem_bytes)

    @property
    def ctas_per_sm(self) -> Optional[int]:
        found = self.occupancy()
        return None if found is None else found.ctas_per_sm

    @property
    def warps_per_sm(self) -> Optional[int]:
        found = self.occupancy()
        return None if found is None else found.warps_per_sm

    @property
    def occupancy_limiter(self) -> Optional[str]:
        found = self.occupancy()
        return None if found is None else found.limiter


def _define_block(defines: Mapping[str, object]) -> str:
    lines = [f"#define {name} {value}" for name, value in sorted(defines.items())]
    return "\n".join(lines) + "\n"


@memoize("fallback_kernels.sources")
def _read(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def source_text(source: str, defines: Mapping[str, object]) -> str:
    """The exact text NVRTC compiles for ``source``: defines, common.cu, then the file."""
    return (_define_block(defines) + f'#line 1 "{COMMON_SOURCE}"\n' + _read(COMMON_SOURCE)
            + f'\n#line 1 "{source}"\n' + _read(source))


class KernelCompileError(RuntimeError):
    """NVRTC rejected a source; the message carries its log."""


# One lock per stripe of program keys: a program is compiled once even when threads ask for it
# together, while different programs compile concurrently (NVRTC releases the GIL in CuPy).
_COMPILE_LOCKS = tuple(threading.Lock() for _ in range(32))
# Compiled programs: (source, defines, expressions, arch) -> CompiledProgram.
_PROGRAMS = LRU("fallback_kernels.programs", None)


def compile_program(source: str, defines: Mapping[str, object], expressions: Sequence[str],
                    arch: str) -> CompiledProgram:
    """Compile the name expressions of ``source`` for ``arch`` as one NVRTC program (memoized per
    process, and on disk per machine: see ``cubin_cache``). The package compiles one expression
    per program (``compile_variant``); several are allowed (one cubin holding them all)."""
    return _compiled(source, defines, tuple(expressions), arch)[0]


def _compiled(source: str, defines: Mapping[str, object], expressions: tuple[str, ...],
              arch: str) -> tuple[CompiledProgram, str]:
    """``compile_program`` and where the program came from: "memory", "disk" or "compiled"."""
    key = (source, tuple(sorted(defines.items())), expressions, arch)
    found = _PROGRAMS.get(key)
    if found is not None:
        return found, "memory"
    with _COMPILE_LOCKS[hash(key) % len(_COMPILE_LOCKS)]:
        found = _PROGRAMS.get(key)  # compiled by another thread while this one waited
        if found is not None:
            return found, "memory"
        from cupy.cuda import nvrtc  # imported late: the package imports without CuPy

        text = source_text(source, defines)
        disk_key = cubin_cache.program_key(text, expressions, arch, NVRTC_OPTIONS,
                                           cubin_cache.nvrtc_version())
        stored = cubin_cache.load(disk_key, expressions)
        if stored is not None:
            return _PROGRAMS.put(key, CompiledProgram(source, arch, *stored)), "disk"
        prog = nvrtc.createProgram(text, source, [], [])
        try:
            for expression in expressions:
                nvrtc.addNameExpression(prog, expression)
            try:
                nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS])
            except nvrtc.NVRTCError as exc:
                raise KernelCompileError(
                    f"NVRTC could not compile {source} for {arch}: {exc}\n"
                    f"{nvrtc.getProgramLog(prog)}") from None
            lowered = {e: nvrtc.getLoweredName(prog, e) for e in expressions}
            program = CompiledProgram(source, arch, nvrtc.getCUBIN(prog), lowered,
                                      nvrtc.getProgramLog(prog))
        finally:
            nvrtc.destroyProgram(prog)
        cubin_cache.store(disk_key, program.cubin, program.lowered, program.log)
        return _PROGRAMS.put(key, program), "compiled"


@dataclass(frozen=True)
class KernelBuild:
    """One variant built for one arch by ``compile_variant``: its record, the seconds it took,
    and where its cubin came from: ``"compiled"`` (NVRTC ran), ``"disk"`` (the cubin cache) or
    ``"memory"`` (already built in this process)."""

    record: CompileRecord
    seconds: float
    origin: str


def compile_variant(variant: KernelVariant, defines: Mapping[str, object],
                    arch: str) -> KernelBuild:
    """Compile one kernel variant (its own NVRTC program) for ``arch`` and read its budget."""
    start = time.perf_counter()
    program, origin = _compiled(variant.source, defines, (variant.expression,), arch)
    (record,) = compile_records(program, [variant])
    return KernelBuild(record, time.perf_counter() - start, origin)


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_usage(log: str) -> dict[str, dict[str, int]]:
    """Parse ``ptxas -v`` output: mangled name -> registers, spills, stack and static shared
    memory bytes (``static_smem_bytes``, on the "Used ... registers" line when non-zero)."""
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current = usage.setdefault(entry.group(1), {})
            continue
        if current is None:
            continue
        frame = _FRAME.search(line)
        if frame:
            current["stack_bytes"], current["spill_stores"], current["spill_loads"] = map(
                int, frame.groups())
        regs = _REGS.search(line)
        if regs:
            current["registers"] = int(regs.group(1))
            smem = _SMEM.search(line)
            if smem:
                current["static_smem_bytes"] = int(smem.group(1))
    return usage


def compile_records(program: CompiledProgram,
                    variants: Sequence[KernelVariant]) -> list[CompileRecord]:
    usage = ptxas_usage(program.log)
    records = []
    for variant in variants:
        found = usage.get(program.lowered[variant.expression])
        if found is None or "registers" not in found:
            raise KernelCompileError(f"ptxas reported nothing for {variant.kernel} on "
                                     f"{program.arch}:\n{program.log}")
        records.append(CompileRecord(variant.kernel, program.arch, found["registers"],
                                     found.get("spill_stores", 0), found.get("spill_loads", 0),
                                     found.get("stack_bytes", 0), variant.expression,
                                     found.get("static_smem_bytes", 0),
                                     variant.dynamic_smem_bytes, variant.threads))
    return records


# Functions loaded on a device: (source, defines, device, expression) -> Function.
_FUNCTIONS = LRU("fallback_kernels.functions", None)


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def get_function(source: str, defines: Mapping[str, object], expression: str,
                 device_index: int, arch: str | None = None):
    """The launchable CuPy function for ``expression`` on CUDA device ``device_index``.

    Only that variant is compiled (or read from the cubin cache) and loaded, once per device;
    functions are memoized. ``arch``: the target to compile for (default the device's own, e.g.
    ``sm_90``; an arch-specific one such as ``sm_90a`` for instructions only it has).
    """
    key = (source, tuple(sorted(defines.items())), device_index, expression, arch)
    function = _FUNCTIONS.get(key)
    if function is not None:
        return function
    import cupy

    program = compile_program(source, defines, (expression,), arch or device_arch(device_index))
    with cupy.cuda.Device(device_index):
        module = cupy.cuda.function.Module()
        module.load(program.cubin)
        # The Function keeps a reference to its module, so the module lives as long as it does.
        function = module.get_function(program.lowered[expression])
    return _FUNCTIONS.put(key, function)
