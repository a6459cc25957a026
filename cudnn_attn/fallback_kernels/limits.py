"""What the CuPy kernels can run, declared once.

``LIMITS`` is the engine's whole envelope (dtypes, head dims, machine, features, masks);
``kernel_reasons(device)`` answers "can the kernels run here?" (CuPy importable, CUDA, NVRTC
loadable, compute capability) for every caller: the backend's ``supports()`` and the NATTEN compat
layers alike; ``problem_reasons(problem)`` lists what a problem asks beyond ``LIMITS``. Importing
this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._probe import cuda_missing, module_missing
from ..caches import memoize

__all__ = ["Limits", "LIMITS", "FUSED_DTYPES", "MAX_HEAD_DIM", "kernel_reasons",
           "machine_reasons", "problem_reasons"]


@dataclass(frozen=True)
class Limits:
    """The envelope of the fused kernels (the ``"cupy"`` engine)."""

    dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)
    max_head_dim: int = 128
    min_compute_capability: tuple = (8, 0)   # mma.sync with bf16
    needs_nvrtc: bool = True                 # compiled at run time, no toolkit
    dropout: bool = False
    bias_tensor: bool = False
    alibi: bool = False
    padding: bool = False
    dropout_mask: bool = False
    rel_pos_bias: str = "forward only, stride 1"   # the fused forward adds it; no gradient
    masks: str = "one Neighborhood, or 1-D bands (dense, Causal, SlidingWindow) of one alignment"


LIMITS = Limits()
FUSED_DTYPES = LIMITS.dtypes
MAX_HEAD_DIM = LIMITS.max_head_dim


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


@memoize("fallback_kernels.nvrtc_missing", maxsize=1)
def _nvrtc_missing() -> list[str]:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # cupy without a loadable NVRTC library
        return [f"the NVRTC library cannot be loaded through CuPy: {exc}"]
    return []


def machine_reasons() -> list[str]:
    """Reasons that hold on this machine whatever the device: CuPy, CUDA, NVRTC."""
    cupy = module_missing("cupy", "cu12")
    reasons = cupy + cuda_missing()
    if not cupy and LIMITS.needs_nvrtc:
        reasons += list(_nvrtc_missing())
    return reasons


def kernel_reasons(device=None) -> list[str]:
    """Why the CuPy kernels cannot run on ``device`` (default: torch's current CUDA device);
    empty when they can. Checks CuPy, CUDA, the NVRTC library, that ``device`` is a CUDA device
    and its compute capability. Never raises, never compiles."""
    reasons = machine_reasons()
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            reasons.append(f"the CuPy kernels run CUDA tensors; these are on {device}")
            return reasons
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        need = LIMITS.min_compute_capability
        if (major, minor) < need:
            reasons.append(f"the fused kernels need compute capability >= {need[0]}.{need[1]} "
                           f"(mma.sync bf16), device has {major}.{minor}")
    return reasons


def problem_reasons(problem) -> list[str]:
    """What ``problem`` (an ``AttnProblem``) asks beyond ``LIMITS``, masks aside."""
    reasons = []
    if problem.dtype not in LIMITS.dtypes:
        reasons.append(f"dtype {problem.dtype} is not supported ({_dtype_names(LIMITS.dtypes)})")
    head_dim = max(problem.dim_qk, problem.dim_v)
    if head_dim > LIMITS.max_head_dim:
        reasons.append(f"head dim {head_dim} exceeds {LIMITS.max_head_dim}")
    if problem.dropout_p > 0 and not LIMITS.dropout:
        reasons.append("dropout is not supported")
    if problem.bias is not None and not LIMITS.bias_tensor:
        reasons.append("a bias tensor is not supported")
    if problem.alibi is not None and not LIMITS.alibi:
        reasons.append("ALiBi is not supported")
    if problem.padding is not None and not LIMITS.padding:
        reasons.append("Padding masks are not supported")
    if problem.storage is not None:
        reasons.append(f"the kernels address dense batches, not {problem.storage!r} storage")
    if problem.score_mod is not None:
        reasons.append("a cuDNN score_mod program is not supported (the torch and cuDNN "
                       "engines run it)")
    if problem.dropout_mask is not None and not LIMITS.dropout_mask:
        reasons.append("an explicit dropout mask is not supported")
    if problem.rpb is not None:
        if problem.requires_grad:
            reasons.append(f"RelPosBias runs {LIMITS.rel_pos_bias}: its gradient is not "
                           "computed by the fused kernels")
        if any(s > 1 for s in problem.neighborhood.stride):
            reasons.append(f"RelPosBias runs {LIMITS.rel_pos_bias}: stride > 1 is not supported")
    return reasons
