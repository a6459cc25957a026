"""NATTEN 0.21's backend and tuning arguments: validated as NATTEN validates them, then read as hints.

NATTEN picks among its own kernels (``cutlass-fna``, ``hopper-fna``, ``blackwell-fna``,
``flex-fna``; ``*-fmha`` for plain attention) and tunes them with tile shapes, KV splits and a
Hopper kernel schedule. None of those kernels exist here. A NATTEN backend name therefore lets
``cudnn_attn`` pick its fastest engine for the call (``"auto"``), and the tuning arguments are checked
(a malformed value raises what NATTEN raises) and otherwise do not change the result or the engine.
Our own names (``"auto"``, ``"cudnn"``, ``"cupy"``, ``"torch"``) pick that engine, as everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...model import checks
from ...errors import NotSupportedError

__all__ = ["NATTEN_NA_BACKENDS", "NATTEN_FMHA_BACKENDS", "OUR_BACKENDS", "engine_for",
           "check_hints", "tuning"]

NATTEN_NA_BACKENDS = ("cutlass-fna", "hopper-fna", "blackwell-fna", "flex-fna")
NATTEN_FMHA_BACKENDS = ("cutlass-fmha", "hopper-fmha", "blackwell-fmha", "flex-fmha")
OUR_BACKENDS = ("auto", "cudnn", "cupy", "torch")
KERNEL_SCHEDULES = ("non", "coop", "pp")


def engine_for(backend, natten_names: tuple) -> str:
    """Our backend name for NATTEN's ``backend`` argument (``None`` and NATTEN's names: auto)."""
    if backend is None or backend in natten_names:
        return "auto"
    if backend in OUR_BACKENDS:
        return backend
    # NATTEN raises NotImplementedError for a name it does not know; NotSupportedError is one.
    raise NotSupportedError(f"backend={backend!r}", {"natten": [
        f"unrecognized backend {backend!r}; NATTEN's are {', '.join(natten_names)} and "
        f"cudnn_attn's are {', '.join(OUR_BACKENDS)}"]})


def _tile_shape(name: str, value, rank: int):
    """NATTEN's rule: an iterable of at most 3 ints; here also one entry per axis (a tile of
    another rank cannot tile this problem)."""
    if value is None:
        return None
    if not (isinstance(value, Sequence) and not isinstance(value, str) and len(value) <= 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
        raise ValueError(f"Unsupported value for tile shape; expected an iterable of at most 3 "
                         f"integers, got {name}={value!r}")
    if len(value) != rank or any(x < 1 for x in value):
        raise ValueError(f"{name} must have {rank} positive entries (one per axis), got {value!r}")
    return tuple(value)


def _tile_size(name: str, value):
    return None if value is None else checks.integer(name, value, 1)


def _kernel_schedule(value):
    if value is None or value in KERNEL_SCHEDULES or type(value).__name__ == "KernelSchedule":
        return value
    raise ValueError(f"Kernel schedule {value} is invalid; choices are: `non` (non-persistent), "
                     f"`coop` (warp-specialized cooperative), and `pp` (warp-specialized "
                     f"ping-ponging).")


def tuning(tiles: dict, backward_kv_splits, backward_use_pt_reduction, run_persistent_kernel,
           kernel_schedule, torch_compile) -> dict | None:
    """One call's tuning arguments as :func:`check_hints` takes them (``tiles``: the tile
    arguments by name); ``None`` when every one is NATTEN's default (valid: nothing to check)."""
    if (all(t is None for t in tiles.values()) and backward_kv_splits is kernel_schedule is None
            and backward_use_pt_reduction is False and run_persistent_kernel is True
            and torch_compile is False):
        return None
    return dict(tiles=tiles, backward_kv_splits=backward_kv_splits,
                backward_use_pt_reduction=backward_use_pt_reduction,
                run_persistent_kernel=run_persistent_kernel, kernel_schedule=kernel_schedule,
                torch_compile=torch_compile)


def check_hints(rank: int | None, *, tiles: dict, backward_kv_splits, backward_use_pt_reduction,
                run_persistent_kernel, kernel_schedule, torch_compile) -> None:
    """Validate the tuning arguments of one call. ``rank``: the neighborhood rank, whose tiles
    are shapes (``None`` for plain attention, whose tiles are sizes)."""
    kind = "size" if rank is None else "shape"
    for step in ("", "backward_"):  # NATTEN's kernels take both tiles of a pass, or neither
        q_name, kv_name = f"{step}q_tile_{kind}", f"{step}kv_tile_{kind}"
        if (tiles.get(q_name) is None) != (tiles.get(kv_name) is None):
            raise ValueError(f"Please specify both {q_name} and {kv_name}, or neither one. Got "
                             f"{q_name}={tiles.get(q_name)!r}, {kv_name}={tiles.get(kv_name)!r}.")
    for name, value in tiles.items():
        if rank is None:
            _tile_size(name, value)
        else:
            _tile_shape(name, value, rank)
    if backward_kv_splits is not None:
        if rank is None:
            _tile_size("backward_kv_splits", backward_kv_splits)
        else:
            _tile_shape("backward_kv_splits", backward_kv_splits, rank)
    for name, value in (("backward_use_pt_reduction", backward_use_pt_reduction),
                        ("run_persistent_kernel", run_persistent_kernel),
                        ("torch_compile", torch_compile)):
        checks.flag(name, value)
    _kernel_schedule(kernel_schedule)
