"""Theoretical occupancy of a kernel from its compile record: CTAs and warps per SM.

The CUDA occupancy calculator's rules (``cuda_occupancy.h``), for the architectures the kernels
compile for: registers are allocated per warp in units of 256 and per SM sub-partition (4 per SM,
each holding a quarter of the register file); shared memory per CTA is the static plus the
dynamic bytes plus 1 KB the system reserves per CTA (sm_80 on), rounded up to 128 bytes; threads
and CTAs per SM are capped. The fewest CTAs any resource allows is the occupancy, and that
resource its limiter. Pure arithmetic: no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SmLimits", "SM_LIMITS", "Occupancy", "sm_limits", "occupancy", "arch_number"]


@dataclass(frozen=True)
class SmLimits:
    """Per-SM resources of one compute capability."""

    shared_bytes: int            # shared memory an SM gives its CTAs (the largest carve-out)
    max_threads: int = 2048
    max_ctas: int = 32
    registers: int = 65536
    register_unit: int = 256     # registers are allocated per warp in these units
    sub_partitions: int = 4      # each holds registers / sub_partitions of the file
    shared_unit: int = 128       # shared memory allocation granularity
    reserved_shared: int = 1024  # per CTA, taken by the system (sm_80 on)


# CUDA C Programming Guide, "Compute capabilities": A100 (8.0) 164 KB per SM, 2048 threads,
# 32 CTAs; 8.6 / 8.9 100 KB, 1536 threads, 16 / 24 CTAs; Hopper (9.0) and Blackwell (10.0) 228 KB.
SM_LIMITS = {
    80: SmLimits(164 * 1024),
    86: SmLimits(100 * 1024, max_threads=1536, max_ctas=16),
    89: SmLimits(100 * 1024, max_threads=1536, max_ctas=24),
    90: SmLimits(228 * 1024),
    100: SmLimits(228 * 1024),
}


def arch_number(arch: str) -> int:
    """``"sm_90a"`` -> 90."""
    digits = "".join(ch for ch in arch.split("_", 1)[-1] if ch.isdigit())
    if not digits:
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    return int(digits)


def sm_limits(arch: str) -> SmLimits:
    """The limits of ``arch``: its own entry, else the newest listed one below it."""
    number = arch_number(arch)
    known = [n for n in SM_LIMITS if n <= number]
    if not known:
        raise ValueError(f"no SM limits for {arch} (known: sm_{min(SM_LIMITS)} and newer)")
    return SM_LIMITS[max(known)]


@dataclass(frozen=True)
class Occupancy:
    """CTAs per SM allowed by each resource, the result and what limits it."""

    by_registers: int
    by_shared: int
    by_threads: int
    max_ctas: int
    warps_per_cta: int

    @property
    def ctas_per_sm(self) -> int:
        return min(self.by_registers, self.by_shared, self.by_threads, self.max_ctas)

    @property
    def warps_per_sm(self) -> int:
        return self.ctas_per_sm * self.warps_per_cta

    @property
    def limiter(self) -> str:
        """The resources that allow no more than ``ctas_per_sm`` ("+"-joined when tied)."""
        found = [name for name, n in (("registers", self.by_registers),
                                      ("shared memory", self.by_shared),
                                      ("threads", self.by_threads), ("CTA slots", self.max_ctas))
                 if n == self.ctas_per_sm]
        return "+".join(found)


def occupancy(arch: str, *, registers: int, threads: int, static_shared: int = 0,
              dynamic_shared: int = 0) -> Occupancy:
    """Theoretical occupancy of a kernel on ``arch`` launched with ``threads`` per CTA."""
    if threads < 1 or registers < 0 or static_shared < 0 or dynamic_shared < 0:
        raise ValueError(f"occupancy needs threads >= 1 and non-negative resources, got "
                         f"threads={threads}, registers={registers}, static_shared="
                         f"{static_shared}, dynamic_shared={dynamic_shared}")
    lim = sm_limits(arch)
    warps = -(-threads // 32)
    unit = lim.register_unit
    per_warp = -(-registers * 32 // unit) * unit
    if per_warp == 0:
        by_registers = lim.max_ctas
    else:
        warps_per_part = (lim.registers // lim.sub_partitions) // per_warp
        by_registers = (warps_per_part * lim.sub_partitions) // warps
    unit = lim.shared_unit
    per_cta = -(-(static_shared + dynamic_shared + lim.reserved_shared) // unit) * unit
    by_shared = lim.shared_bytes // per_cta
    return Occupancy(by_registers, by_shared, lim.max_threads // (warps * 32), lim.max_ctas,
                     warps)
