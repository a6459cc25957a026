"""Launchers of the unfused neighborhood-attention kernels (NATTEN 0.17's ``na*d_qk``/``na*d_av``).

Layouts, heads first and made contiguous here (``S`` = the spatial dims, ``N = prod(S)``)::

    query, key, value, out, d_out     [B, H, *S, D]
    attn, d_attn                      [B, H, *S, KK]        KK = prod(kernel_size)
    rpb                               [H, 2*k0-1 (, 2*k1-1 (, 2*k2-1))]

Slot ``(t0, t1, t2)`` of ``attn`` (row-major over the kernel dims) holds, per axis, the key
``window_start + t * dilation`` of the NATTEN window of that query; causally truncated windows keep
their valid keys in the first slots, the others are ``-inf`` in ``qk_forward`` and carry no
gradient. No scaling anywhere. The RPB entry of a slot is ``(key - query) / dilation + k - 1`` per
axis, added in the accumulator type (float32, or float64 for float64 inputs); ``drpb`` comes back
in that accumulator type too (callers cast it to their parameter's dtype).

Equivalent PyTorch (1-D, ``keys[i, t]`` / ``valid[i, t]`` the slot tables)::

    attn = (query[:, :, :, None] * key[:, :, keys]).sum(-1).masked_fill(~valid, -inf)  # qk_forward
    out = (attn.masked_fill(~valid, 0)[..., None] * value[:, :, keys]).sum(-2)         # av_forward

Every output element is computed by one thread in a fixed order, so results are bitwise
repeatable; launches go through ``launch`` (torch's current stream, tensors through DLPack).
"""

from __future__ import annotations

import math

import torch

from ..model import checks
from ..model.geometry import MAX_AXES, neighborhood_table
from ..model.problem import accumulator_dtype
from . import launch
from ._loader import KernelVariant, get_function

SOURCE = "unfused.cu"
THREADS = 256        # block size of the element-wise kernels
RPB_THREADS = 256    # block size of the drpb reduction (a power of two)
MAX_BLOCKS = 1 << 20  # grid caps; the kernels loop over the rest (grid-stride)
MAX_GRID_Y = 65535
INT32_MAX = 2**31 - 1
DEFINES = {"NA_UNFUSED_THREADS": THREADS, "NA_RPB_THREADS": RPB_THREADS}

_DTYPES = {torch.float64: "double", torch.float32: "float", torch.float16: "na_half",
           torch.bfloat16: "na_bf16"}
_KERNELS = ("na_neighbor_dot", "na_neighbor_gather", "na_inverse_gather", "na_rpb_backward")


def variants() -> list[KernelVariant]:
    """Every template instance this module launches: 4 kernels x 4 dtypes."""
    return [KernelVariant(SOURCE, f"{name}<{ctype}>", f"unfused.{name}.{ctype}",
                          RPB_THREADS if name == "na_rpb_backward" else THREADS)
            for name in _KERNELS for ctype in _DTYPES.values()]


# ---------------------------------------------------------------------------------------------
# Pure-Python geometry (CPU-testable)
# ---------------------------------------------------------------------------------------------

def stride1_table(spatial_shape, kernel_size, dilation, is_causal) -> tuple[int, ...]:
    """The geometry table (``geometry.neighborhood_table``) of a stride-1 neighborhood: NATTEN
    0.17's ops have no stride."""
    return tuple(neighborhood_table(spatial_shape, kernel_size, (1,) * len(kernel_size),
                                    dilation, is_causal))


def launch_grid(per_head: int, batch_heads: int, threads: int = THREADS) -> tuple[int, int]:
    """Grid ``(x, y)`` of an element-wise kernel: x strides over the ``per_head`` elements of one
    (batch, head), y over the ``batch_heads`` pairs; both loops are grid-stride, so the grid is
    capped. ``(0, 0)`` when there is nothing to do.
    """
    if per_head <= 0 or batch_heads <= 0:
        return (0, 0)
    return (min(-(-per_head // threads), MAX_BLOCKS), min(batch_heads, MAX_GRID_Y))


def rpb_shape(heads: int, kernel_size) -> tuple[int, ...]:
    return (heads, *(2 * k - 1 for k in kernel_size))


def _check_geometry(spatial, kernel_size, dilation, is_causal):
    rank = len(spatial)
    for name, value in (("kernel_size", kernel_size), ("dilation", dilation),
                        ("is_causal", is_causal)):
        if not isinstance(value, (tuple, list)) or len(value) != rank:
            raise ValueError(f"{name} must be a tuple of {rank} entries (one per spatial axis), "
                             f"got {value!r}")
    for axis, (L, k, d) in enumerate(zip(spatial, kernel_size, dilation)):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"kernel_size[{axis}] must be a positive int, got {k!r}")
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise ValueError(f"dilation[{axis}] must be a positive int, got {d!r}")
        if k * d > L:
            raise ValueError(f"kernel_size[{axis}] * dilation[{axis}] = {k}*{d} exceeds the "
                             f"spatial size {L} of axis {axis}")


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _check_tensor(name: str, t, rank: int):
    checks.tensor(name, t, ndim=rank + 3, what=f"[B, H, *spatial ({rank} dims), last]",
                   dtypes=_DTYPES)
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")


def _check_like(name: str, t, shape, ref_name: str, ref):
    _check_tensor(name, t, len(shape) - 3)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != ref.dtype or t.device != ref.device:
        raise TypeError(f"{name} ({t.dtype}, {t.device}) must match {ref_name} "
                        f"({ref.dtype}, {ref.device})")


def _check_rpb_allowed(kernel_size, is_causal):
    if any(is_causal):
        raise ValueError(f"rpb is not supported with causal masking (is_causal={is_causal!r})")
    if any(k % 2 == 0 for k in kernel_size):
        raise ValueError(f"rpb needs odd kernel sizes, got kernel_size={kernel_size!r}")


def _rank(kernel_size) -> int:
    if not isinstance(kernel_size, (tuple, list)) or not 1 <= len(kernel_size) <= MAX_AXES:
        raise ValueError(f"kernel_size must be a tuple of 1 to 3 ints, got {kernel_size!r}")
    return len(kernel_size)


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------

class _Launch:
    """Device, stream and geometry of one call; launches the kernel instance for ``dtype``."""

    def __init__(self, ref: torch.Tensor, spatial, kernel_size, dilation, is_causal):
        _check_geometry(spatial, kernel_size, dilation, is_causal)
        self.device = ref.device
        self.dtype = ref.dtype
        self.table = launch.device_table(stride1_table(spatial, kernel_size, dilation, is_causal),
                                         ref.device)

    def __call__(self, name: str, grid: tuple, threads: int, tensors, scalars):
        if 0 in grid:
            return
        expression = f"{name}<{_DTYPES[self.dtype]}>"
        with launch.TorchStream(self.device) as ctx:
            fn = get_function(SOURCE, DEFINES, expression, ctx.index)
            args = [launch.kernel_arg(t) for t in (*tensors, self.table)] + list(scalars)
            fn(grid, (threads,), tuple(args), stream=ctx.stream)


def _i32(x):
    import numpy as np

    return np.int32(x)


def _check_sizes(B, H, per_head):
    # The kernels index one (batch, head) and count (batch, head) pairs in int32.
    if B * H > INT32_MAX or per_head > INT32_MAX:
        raise ValueError(f"tensor too large for the unfused kernels: B*H={B * H}, elements per "
                         f"(batch, head)={per_head} (each must be < 2**31)")


def _dot(launch, a, b, rpb, w, heads, invalid_neg_inf):
    B, H = w.shape[:2]
    per_head = math.prod(w.shape[2:])
    _check_sizes(B, H, per_head)
    has_rpb = rpb is not None
    # Without rpb the kernel never reads that pointer; any device buffer of the right type does.
    rpb_arg = rpb if has_rpb else torch.empty(1, dtype=accumulator_dtype(a.dtype), device=a.device)
    launch("na_neighbor_dot", launch_grid(per_head, B * H), THREADS, (a, b, rpb_arg, w),
           (_i32(B * H), _i32(heads), _i32(a.shape[-1]), _i32(has_rpb), _i32(invalid_neg_inf)))


def _gather(launch, name, w, rows, out):
    B, H = out.shape[:2]
    per_head = math.prod(out.shape[2:])
    _check_sizes(B, H, per_head)
    launch(name, launch_grid(per_head, B * H), THREADS, (w, rows, out),
           (_i32(B * H), _i32(out.shape[-1])))


def _output(buffer, shape, ref, name):
    """The tensor the kernel writes: ``buffer`` itself when contiguous, else a fresh one."""
    if buffer is None:
        return torch.empty(shape, dtype=ref.dtype, device=ref.device)
    _check_like(name, buffer, shape, "the inputs", ref)
    return buffer if buffer.is_contiguous() else torch.empty(shape, dtype=ref.dtype,
                                                               device=ref.device)


def _finish(result, buffer):
    if buffer is not None and buffer is not result:
        buffer.copy_(result)
        return buffer
    return result


def qk_forward(query, key, rpb, kernel_size, dilation, is_causal, attn=None):
    """``attn[b, h, *i, slot] = <query[b, h, *i], key[b, h, *key(i, slot)]> (+ rpb)``, -inf in
    invalid slots; ``[B, H, *S, prod(kernel_size)]`` in query's dtype, written into ``attn`` when
    given. No scaling.
    """
    rank = _rank(kernel_size)
    _check_tensor("query", query, rank)
    _check_like("key", key, query.shape, "query", query)
    spatial = tuple(query.shape[2:-1])
    launch = _Launch(query, spatial, kernel_size, dilation, is_causal)
    H = query.shape[1]
    if rpb is not None:
        _check_rpb_allowed(kernel_size, is_causal)
        if not isinstance(rpb, torch.Tensor):
            raise TypeError(f"rpb must be a torch.Tensor or None, got {type(rpb).__name__}")
        if tuple(rpb.shape) != rpb_shape(H, kernel_size):
            raise ValueError(f"rpb must have shape {rpb_shape(H, kernel_size)}, got "
                             f"{tuple(rpb.shape)}")
        if rpb.device != query.device or not rpb.is_floating_point():
            raise TypeError(f"rpb must be a floating tensor on {query.device}, got {rpb.dtype} on "
                            f"{rpb.device}")
        rpb = rpb.to(accumulator_dtype(query.dtype)).contiguous()
    shape = (*query.shape[:-1], math.prod(kernel_size))
    result = _output(attn, shape, query, "attn")
    _dot(launch, query.contiguous(), key.contiguous(), rpb, result, H, True)
    return _finish(result, attn)


def qk_backward(d_attn, query, key, kernel_size, dilation, is_causal, need_rpb_grad):
    """Gradients of :func:`qk_forward`: ``(dq, dk, drpb)``; invalid slots of ``d_attn`` are
    ignored. ``drpb`` (``[H, 2*k-1, ...]``, float32, float64 for float64 inputs) is None unless
    ``need_rpb_grad``.

    Equivalent PyTorch: ``torch.autograd.grad(qk(query, key, rpb), (query, key, rpb), d_attn)``.
    """
    rank = _rank(kernel_size)
    _check_tensor("query", query, rank)
    _check_like("key", key, query.shape, "query", query)
    _check_like("d_attn", d_attn, (*query.shape[:-1], math.prod(kernel_size)), "query", query)
    launch = _Launch(query, tuple(query.shape[2:-1]), kernel_size, dilation, is_causal)
    d_attn, query, key = d_attn.contiguous(), query.contiguous(), key.contiguous()
    dq, dk = torch.empty_like(query), torch.empty_like(key)
    _gather(launch, "na_neighbor_gather", d_attn, key, dq)
    _gather(launch, "na_inverse_gather", d_attn, query, dk)
    drpb = None
    if need_rpb_grad:
        _check_rpb_allowed(kernel_size, is_causal)
        B, H = query.shape[:2]
        drpb = torch.empty(rpb_shape(H, kernel_size), dtype=accumulator_dtype(query.dtype),
                           device=query.device)
        launch("na_rpb_backward", (min(drpb.numel(), MAX_BLOCKS),), RPB_THREADS, (d_attn, drpb),
               (_i32(B), _i32(H)))
    return dq, dk, drpb


def av_forward(attn, value, kernel_size, dilation, is_causal, out=None):
    """``out[b, h, *i] = sum over valid slots of attn[b, h, *i, slot] * value[b, h, *key(i, slot)]``
    (``[B, H, *S, D]``, value's dtype), written into ``out`` when given.
    """
    rank = _rank(kernel_size)
    _check_tensor("value", value, rank)
    _check_like("attn", attn, (*value.shape[:-1], math.prod(kernel_size)), "value", value)
    launch = _Launch(value, tuple(value.shape[2:-1]), kernel_size, dilation, is_causal)
    result = _output(out, value.shape, value, "out")
    _gather(launch, "na_neighbor_gather", attn.contiguous(), value.contiguous(), result)
    return _finish(result, out)


def av_backward(d_out, attn, value, kernel_size, dilation, is_causal):
    """Gradients of :func:`av_forward`: ``(d_attn, d_value)``; ``d_attn`` is 0 in invalid slots.

    Equivalent PyTorch: ``torch.autograd.grad(av(attn, value), (attn, value), d_out)``.
    """
    rank = _rank(kernel_size)
    _check_tensor("value", value, rank)
    _check_like("attn", attn, (*value.shape[:-1], math.prod(kernel_size)), "value", value)
    _check_like("d_out", d_out, value.shape, "value", value)
    launch = _Launch(value, tuple(value.shape[2:-1]), kernel_size, dilation, is_causal)
    d_out, attn, value = d_out.contiguous(), attn.contiguous(), value.contiguous()
    d_attn, d_value = torch.empty_like(attn), torch.empty_like(value)
    _dot(launch, d_out, value, None, d_attn, value.shape[1], False)
    _gather(launch, "na_inverse_gather", attn, d_out, d_value)
    return d_attn, d_value
