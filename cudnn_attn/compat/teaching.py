"""The tiled flash-attention teaching API.

The public surface mirrors a small "Modern Flash Attention" CUDA extension (its Python wrapper, API
reference and ``flash.cu``): ``flash_attention_forward``, ``flash_attention_backward``, the
``FlashAttention`` module, ``get_optimal_block_sizes`` and ``estimate_memory_usage``. The code here is
this project's own: the classic tiled algorithm, written so each step of the paper can be read in it.

Algorithm (FlashAttention-2, Dao 2023, Algorithms 1 and 2), for Q, K, V of shape ``[B, H, N, D]``:

* forward: for each query tile Q_i of ``Br`` rows, walk the key/value tiles K_j, V_j of ``Bc`` rows
  with an online softmax: ``S = scale * Q_i K_j^T``, ``m_new = max(m, rowmax(S))``,
  ``P = exp(S - m_new)``, ``l = exp(m - m_new) * l + rowsum(P)``,
  ``O_i = exp(m - m_new) * O_i + P V_j``; after the last tile ``O_i /= l``. ``m`` ends as the row
  maximum of the scaled scores and ``l`` as the row sum of ``exp(scaled - m)``, so the log-sum-exp is
  ``m + log(l)``.
* backward: ``D_i = rowsum(dO_i * O_i)``; for each key tile j and query tile i, recompute
  ``P = exp(S - m) / l``, then ``dV_j += P^T dO_i``, ``dP = dO_i V_j^T``, ``dS = P * (dP - D_i)``,
  ``dQ_i += scale * dS K_j``, ``dK_j += scale * dS^T Q_i``.

The scale is ``D ** -0.5``. Every tile step is a batched torch op over ``B`` and ``H``; only the tile
loops are Python loops. Accumulation is float32 (float64 for float64 inputs).

Precision: ``use_half=True`` stores Q, K, V, O (and dQ, dK, dV) in float16, casting the inputs when they
are not float16 already, while the tile products and the softmax statistics stay float32, as a
tensor-core kernel with fp32 accumulators does. ``use_half=False`` keeps the inputs' dtype
(float32, float16, or float64, the last being this project's extension for gradcheck). ``l`` and ``m``
are float32 (float64 for float64 inputs).

Devices: on CPU this is the engine. On a CUDA device the same tiled torch code runs on the device for
now; the fused CuPy kernel with the same ``Bc``/``Br`` tiles arrives with the CuPy kernel issue.

Tile sizes: ``Bc`` (key/value tile rows, "columns" of S) and ``Br`` (query tile rows) are the tile
sizes actually used. A fused kernel keeps the tiles in shared memory, so sizes whose tiles do not fit
the shared-memory budget (see ``shared_memory_budget``) are rejected on every device, CPU included:
what runs here would also fit on the GPUs this project targets.
"""

from __future__ import annotations

import numbers

import torch
from torch.autograd.function import once_differentiable

from ..model import checks
from ..model.checks import default_scale
from ..model.problem import accumulator_dtype

__all__ = [
    "MAX_THREADS_PER_BLOCK",
    "PORTABLE_SMEM_BUDGET",
    "FlashAttention",
    "backward_smem_bytes",
    "estimate_memory_usage",
    "flash_attention_backward",
    "flash_attention_forward",
    "forward_smem_bytes",
    "get_optimal_block_sizes",
    "shared_memory_budget",
]

# ----------------------------------------------------------------------------------------------------
# Hardware limits.
#
# Shared memory per SM and the largest dynamic allocation one block may opt into
# (cudaDevAttrMaxSharedMemoryPerBlockOptin), from the CUDA C programming guide's compute-capability table:
#
#   arch                    per SM    per block (opt-in)
#   sm_75 (Turing)          64 KB     64 KB  =  65536 B
#   sm_80 (A100)           164 KB    163 KB  = 166912 B
#   sm_86 / sm_89          100 KB     99 KB  = 101376 B
#   sm_90 (H100/H200)      228 KB    227 KB  = 232448 B
#   any, without opt-in               48 KB  =  49152 B  (cudaDevAttrMaxSharedMemoryPerBlock, which
#                                                         is what the seed's flash.cu checks against)
#
# The project targets sm_80 and newer; the tightest of those is sm_86/sm_89 at 99 KB per block. That is
# the budget on CPU (and for get_optimal_block_sizes), so tile sizes accepted here fit every target GPU.
# On a CUDA device the device's own opt-in maximum is the budget.
# ----------------------------------------------------------------------------------------------------

PORTABLE_SMEM_BUDGET = 101376  # bytes: 99 KB, the sm_86/sm_89 per-block opt-in maximum
MAX_THREADS_PER_BLOCK = 1024  # CUDA limit; the seed's kernel launches max(Bc, Br) threads per block

_SUPPORTED_DTYPES = (torch.float16, torch.float32, torch.float64)


def shared_memory_budget(device=None) -> int:
    """Shared-memory bytes one block may use: the CUDA device's opt-in maximum on a CUDA device,
    otherwise ``PORTABLE_SMEM_BUDGET`` (99 KB, the smallest maximum among the sm_80+ targets)."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
            return optin or int(props.shared_memory_per_block)
    return PORTABLE_SMEM_BUDGET


def _elem_bytes(dtype: torch.dtype) -> tuple[int, int]:
    """(storage bytes, accumulator bytes) of one element."""
    storage = torch.empty((), dtype=dtype).element_size()
    return storage, (8 if dtype == torch.float64 else 4)


def forward_smem_bytes(Bc: int, Br: int, head_dim: int, dtype: torch.dtype = torch.float32) -> int:
    """Shared memory of one forward tile step: Q_i and O_i (``Br x D``) and K_j, V_j (``Bc x D``) in the
    storage dtype, plus the score tile S (``Br x Bc``) in the accumulator dtype.

    With ``Bc == Br`` this is the seed's ``4 * Bc * d * sizeof(T) + Bc * Br * sizeof(float)``; the seed
    sized the Q tile with ``Bc`` too, here each tile has its own size."""
    e, a = _elem_bytes(dtype)
    return e * (2 * Br * head_dim + 2 * Bc * head_dim) + a * Br * Bc


def backward_smem_bytes(Bc: int, Br: int, head_dim: int, dtype: torch.dtype = torch.float32) -> int:
    """Shared memory of one backward tile step: Q_i and dO_i (``Br x D``), K_j, V_j and the dV_j
    accumulator (``Bc x D``), plus P and dS (``Br x Bc``) in the accumulator dtype.

    With ``Bc == Br`` this is the seed's ``5 * Bc * d * sizeof(T) + 2 * Bc * Br * sizeof(float)``."""
    e, a = _elem_bytes(dtype)
    return e * (2 * Br * head_dim + 3 * Bc * head_dim) + 2 * a * Br * Bc


# ----------------------------------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_block_size(value, name: str) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be a positive int (a tile size), got {value!r} "
                         f"of type {type(value).__name__}")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int (a tile size), got {value}")
    if value > MAX_THREADS_PER_BLOCK:
        raise ValueError(f"{name}={value} exceeds {MAX_THREADS_PER_BLOCK}: the kernel runs one thread per "
                         f"tile row and a CUDA block holds at most {MAX_THREADS_PER_BLOCK} threads")
    return value


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")
    return value


def _check_qkv(Q, K, V):
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        checks.tensor(name, t, ndim=4, what="[B, H, N, D]", dtypes=_SUPPORTED_DTYPES)
    if not (Q.shape == K.shape == V.shape):
        raise ValueError(f"Q, K and V must have the same shape [B, H, N, D], got Q {tuple(Q.shape)}, "
                         f"K {tuple(K.shape)}, V {tuple(V.shape)}")
    if not (Q.dtype == K.dtype == V.dtype):
        raise TypeError(f"Q, K and V must have the same dtype, got {Q.dtype}, {K.dtype}, {V.dtype}")
    if not (Q.device == K.device == V.device):
        raise ValueError(f"Q, K and V must be on the same device, got {Q.device}, {K.device}, {V.device}")
    if Q.shape[-1] < 1:
        raise ValueError(f"head dimension D must be >= 1, got Q shape {tuple(Q.shape)}")


def _check_fits(Bc: int, Br: int, head_dim: int, dtype: torch.dtype, device, backward: bool) -> None:
    budget = shared_memory_budget(device)
    need_f = forward_smem_bytes(Bc, Br, head_dim, dtype)
    need_b = backward_smem_bytes(Bc, Br, head_dim, dtype) if backward else 0
    if need_f <= budget and need_b <= budget:
        return
    which, need = ("forward", need_f) if need_f > budget else ("backward", need_b)
    where = (f"the {budget}-byte budget of {device}" if torch.device(device).type == "cuda"
             else f"the {budget}-byte portable budget (99 KB, sm_86/sm_89 per-block maximum)")
    fit = _largest_fitting(head_dim, dtype, budget, backward)
    hint = "" if fit is None else f"; the largest rung of the tile ladder that fits is (Bc, Br) = {fit}"
    raise ValueError(f"Bc={Bc}, Br={Br} with head_dim={head_dim} ({dtype}) need {need} bytes of shared "
                     f"memory for the {which} tiles, over {where}: use smaller Bc/Br{hint}")


def _check_stats(name, t, Q):
    checks.like(name, t, Q, "Q", expected=Q.shape[:3], what="[B, H, N]", any_float=True)


def _check_like_q(name, t, Q):
    checks.tensor(name, t, dtypes=_SUPPORTED_DTYPES)
    checks.like(name, t, Q, "Q", expected=Q.shape, what="Q's shape", any_float=True)


# ----------------------------------------------------------------------------------------------------
# The tiled kernels (torch ops, batched over B and H).
# ----------------------------------------------------------------------------------------------------


def _tile_ranges(n: int, tile: int):
    """``(start, stop)`` of each tile of ``tile`` rows covering ``n`` rows; the last may be shorter."""
    return [(s, min(s + tile, n)) for s in range(0, n, tile)]


def _forward_tiled(Q, K, V, Bc: int, Br: int):
    B, H, N, D = Q.shape
    acc = accumulator_dtype(Q.dtype)
    scale = default_scale(D)
    # NaN-filled so an element the loops failed to write cannot pass for a result.
    O = torch.full_like(Q, float("nan"))
    l = torch.full((B, H, N), float("nan"), dtype=acc, device=Q.device)
    m = torch.full((B, H, N), float("nan"), dtype=acc, device=Q.device)
    kv_tiles = _tile_ranges(N, Bc)
    for i0, i1 in _tile_ranges(N, Br):
        q_i = Q[:, :, i0:i1].to(acc)
        m_i = torch.full((B, H, i1 - i0), float("-inf"), dtype=acc, device=Q.device)
        l_i = torch.zeros((B, H, i1 - i0), dtype=acc, device=Q.device)
        o_i = torch.zeros((B, H, i1 - i0, D), dtype=acc, device=Q.device)
        for j0, j1 in kv_tiles:
            k_j = K[:, :, j0:j1].to(acc)
            v_j = V[:, :, j0:j1].to(acc)
            s = torch.matmul(q_i, k_j.transpose(-1, -2)) * scale  # [B, H, Br, Bc]
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            alpha = torch.exp(m_i - m_new)  # rescales what was accumulated under the old maximum
            p = torch.exp(s - m_new.unsqueeze(-1))
            l_i = alpha * l_i + p.sum(dim=-1)
            o_i = alpha.unsqueeze(-1) * o_i + torch.matmul(p, v_j)
            m_i = m_new
        O[:, :, i0:i1] = (o_i / l_i.unsqueeze(-1)).to(O.dtype)
        l[:, :, i0:i1] = l_i
        m[:, :, i0:i1] = m_i
    return O, l, m


def _backward_tiled(Q, K, V, O, dO, l, m, Bc: int, Br: int):
    N, D = Q.shape[-2:]
    acc = accumulator_dtype(Q.dtype)
    scale = default_scale(D)
    l = l.to(acc)
    m = m.to(acc)
    delta = (dO.to(acc) * O.to(acc)).sum(dim=-1)  # D_i = rowsum(dO_i * O_i), [B, H, N]
    dQ = torch.zeros(Q.shape, dtype=acc, device=Q.device)
    dK = torch.full_like(K, float("nan"))
    dV = torch.full_like(V, float("nan"))
    q_tiles = _tile_ranges(N, Br)
    for j0, j1 in _tile_ranges(N, Bc):
        k_j = K[:, :, j0:j1].to(acc)
        v_j = V[:, :, j0:j1].to(acc)
        dk_j = torch.zeros_like(k_j)
        dv_j = torch.zeros_like(v_j)
        for i0, i1 in q_tiles:
            q_i = Q[:, :, i0:i1].to(acc)
            do_i = dO[:, :, i0:i1].to(acc)
            s = torch.matmul(q_i, k_j.transpose(-1, -2)) * scale
            p = torch.exp(s - m[:, :, i0:i1].unsqueeze(-1)) / l[:, :, i0:i1].unsqueeze(-1)
            dv_j += torch.matmul(p.transpose(-1, -2), do_i)
            dp = torch.matmul(do_i, v_j.transpose(-1, -2))
            ds = p * (dp - delta[:, :, i0:i1].unsqueeze(-1))
            dQ[:, :, i0:i1] += scale * torch.matmul(ds, k_j)
            dk_j += scale * torch.matmul(ds.transpose(-1, -2), q_i)
        dK[:, :, j0:j1] = dk_j.to(dK.dtype)
        dV[:, :, j0:j1] = dv_j.to(dV.dtype)
    return dQ.to(Q.dtype), dK, dV


class _FlashAttentionFunction(torch.autograd.Function):
    """Autograd around the tiled forward; its backward is ``flash_attention_backward`` on the saved
    Q, K, V, O, l, m. Inputs arrive already in their storage dtype (use_half cast done outside)."""

    @staticmethod
    def forward(ctx, Q, K, V, Bc, Br):
        O, l, m = _forward_tiled(Q, K, V, Bc, Br)
        ctx.save_for_backward(Q, K, V, O, l, m)
        ctx.tiles = (Bc, Br)
        ctx.mark_non_differentiable(l, m)
        return O, l, m

    @staticmethod
    @once_differentiable
    def backward(ctx, dO, _dl, _dm):
        Q, K, V, O, l, m = ctx.saved_tensors
        Bc, Br = ctx.tiles
        dQ, dK, dV = flash_attention_backward(Q, K, V, O, dO, l, m, Bc=Bc, Br=Br, use_half=False)
        return dQ, dK, dV, None, None


# ----------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------


def flash_attention_forward(Q, K, V, Bc=32, Br=32, use_half=False, return_softmax_stats=False):
    """Tiled flash attention, ``softmax(Q K^T / sqrt(D)) V``.

    Args:
        Q, K, V: ``[B, H, N, D]`` tensors of one dtype (float16, float32; float64 also accepted) on one
            device.
        Bc: key/value tile size (columns of the score matrix), default 32.
        Br: query tile size (rows), default 32.
        use_half: store inputs and output in float16 (inputs are cast), accumulating in float32.
        return_softmax_stats: also return ``l`` and ``m``.

    Returns:
        ``O`` (``[B, H, N, D]``; float16 with ``use_half``, else the inputs' dtype), or ``(O, l, m)`` with
        ``m`` the row maximum of the scaled scores and ``l`` the row sum of ``exp(scaled - m)``, both
        ``[B, H, N]`` float32 (float64 for float64 inputs); ``lse = m + log(l)``.

    Differentiable: when an input requires grad, gradients come from ``flash_attention_backward``.

    Raises:
        ValueError: ``Bc``/``Br`` not a positive int, above 1024, or tiles that overflow the shared-memory
            budget (forward tiles, and backward tiles too when a gradient will be needed); shapes that are
            not one ``[B, H, N, D]``; tensors on different devices.
        TypeError: non-tensor inputs, unsupported or mixed dtypes, non-bool flags.
    """
    Bc = _check_block_size(Bc, "Bc")
    Br = _check_block_size(Br, "Br")
    _check_flag(use_half, "use_half")
    _check_flag(return_softmax_stats, "return_softmax_stats")
    _check_qkv(Q, K, V)
    if use_half:
        Q, K, V = (t.to(torch.float16) for t in (Q, K, V))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (Q, K, V))
    _check_fits(Bc, Br, Q.shape[3], Q.dtype, Q.device, backward=needs_grad)
    if needs_grad:
        O, l, m = _FlashAttentionFunction.apply(Q, K, V, Bc, Br)
    else:
        with torch.no_grad():
            O, l, m = _forward_tiled(Q, K, V, Bc, Br)
    return (O, l, m) if return_softmax_stats else O


def flash_attention_backward(Q, K, V, O, dO, l, m, Bc=32, Br=32, use_half=False):
    """Gradients of ``flash_attention_forward`` from its saved output and softmax statistics.

    Args:
        Q, K, V: the forward's inputs, ``[B, H, N, D]``.
        O: the forward's output, ``[B, H, N, D]``.
        dO: gradient with respect to ``O``, ``[B, H, N, D]``.
        l, m: the forward's row sums and row maxima, ``[B, H, N]``.
        Bc, Br, use_half: as in the forward (use the same values).

    Returns:
        ``(dQ, dK, dV)`` in the storage dtype (float16 with ``use_half``, else Q's dtype).

    Raises:
        ValueError / TypeError: as the forward, plus shape, dtype and device checks of ``O``, ``dO``,
        ``l`` and ``m``; the backward tiles must fit the shared-memory budget.
    """
    Bc = _check_block_size(Bc, "Bc")
    Br = _check_block_size(Br, "Br")
    _check_flag(use_half, "use_half")
    _check_qkv(Q, K, V)
    _check_like_q("O", O, Q)
    _check_like_q("dO", dO, Q)
    _check_stats("l", l, Q)
    _check_stats("m", m, Q)
    if use_half:
        Q, K, V, O, dO = (t.to(torch.float16) for t in (Q, K, V, O, dO))
    _check_fits(Bc, Br, Q.shape[3], Q.dtype, Q.device, backward=True)
    with torch.no_grad():
        return _backward_tiled(Q.detach(), K.detach(), V.detach(), O.detach(), dO.detach(), l.detach(),
                               m.detach(), Bc, Br)


class FlashAttention(torch.nn.Module):
    """Module form of the tiled flash attention.

    Args:
        bc: key/value tile size (default 32).
        br: query tile size (default 32).
        use_half: float16 storage with float32 accumulation (default False).

    ``forward(q, k, v)`` is differentiable (autograd calls ``flash_attention_backward``);
    ``backward(q, k, v, o, do, l, m)`` is the explicit backward of the seed's module, for callers that
    keep ``l`` and ``m`` themselves (``forward(..., return_softmax_stats=True)``).
    """

    def __init__(self, bc: int = 32, br: int = 32, use_half: bool = False):
        super().__init__()
        self.bc = _check_block_size(bc, "bc")
        self.br = _check_block_size(br, "br")
        self.use_half = _check_flag(use_half, "use_half")

    def extra_repr(self) -> str:
        return f"bc={self.bc}, br={self.br}, use_half={self.use_half}"

    def forward(self, q, k, v, return_softmax_stats: bool = False):
        return flash_attention_forward(q, k, v, self.bc, self.br, self.use_half,
                                       return_softmax_stats=return_softmax_stats)

    def backward(self, q, k, v, o, do, l, m):
        return flash_attention_backward(q, k, v, o, do, l, m, self.bc, self.br, self.use_half)


# Tile ladder for get_optimal_block_sizes, largest first; each step halves Br, then Bc (Bc >= Br, as in
# the seed's heuristic). Bigger tiles mean fewer passes over K/V (on a GPU) and fewer loop steps (on CPU).
_TILE_LADDER = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8),
                (8, 4), (4, 4), (4, 2), (2, 2), (2, 1), (1, 1))


def _largest_fitting(head_dim: int, dtype: torch.dtype, budget: int, backward: bool):
    """First ``(Bc, Br)`` of ``_TILE_LADDER`` whose tiles fit ``budget``; None when none does."""
    for bc, br in _TILE_LADDER:
        if (forward_smem_bytes(bc, br, head_dim, dtype) <= budget
                and (not backward or backward_smem_bytes(bc, br, head_dim, dtype) <= budget)):
            return bc, br
    return None


def get_optimal_block_sizes(sequence_length: int, head_dim: int) -> tuple[int, int]:
    """``(Bc, Br)`` for a sequence length and head dimension.

    The first rung of ``_TILE_LADDER`` whose forward *and* backward tiles fit the portable 99 KB budget in
    float32 (the wider of the seed's two precisions, so the answer holds for ``use_half`` too), then each
    size clipped to the next power of two >= ``sequence_length`` (a tile longer than the sequence holds
    nothing more). Deterministic and device-independent. The resulting table (before clipping), with the
    float32 forward / backward bytes at the top of each range (the backward is what binds):

        head_dim      (Bc, Br)    fwd / bwd bytes at the range's largest head_dim
        1 .. 17       (128, 64)   58880 / 100352
        18 .. 53      (64, 64)    70656 / 100608
        54 .. 83      (64, 32)    71936 / 101376
        84 .. 145     (32, 32)    78336 / 100992
        146 .. 190    (32, 16)    75008 / 101376
        191 .. 310    (16, 16)    80384 / 101248
        311 .. 392    (16, 8)     75776 / 101376
        393 .. 630    (8, 8)      80896 / 101312
        ...           down to (1, 1), which fits up to head_dim 5068.

    Not tuned on a GPU yet (no device was available); the fused kernel's issue may retune the ladder.

    Raises:
        ValueError: non-int or non-positive arguments, or a head_dim no tile fits (> 5068).
    """
    for name, value in (("sequence_length", sequence_length), ("head_dim", head_dim)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    fit = _largest_fitting(int(head_dim), torch.float32, PORTABLE_SMEM_BUDGET, backward=True)
    if fit is not None:
        cap = 1 << (int(sequence_length) - 1).bit_length()
        return min(fit[0], cap), min(fit[1], cap)
    raise ValueError(f"head_dim={head_dim} is too large: even 1x1 tiles overflow the "
                     f"{PORTABLE_SMEM_BUDGET}-byte shared-memory budget in float32")


def estimate_memory_usage(batch_size: int, num_heads: int, seq_len: int, head_dim: int,
                          use_half: bool = False) -> dict:
    """Device-memory bytes of one flash-attention forward (the seed's formula and keys).

    * ``input_memory``: Q, K, V, ``3 * B * H * N * D * e`` (``e`` = 2 with ``use_half``, else 4);
    * ``internal_memory``: the softmax statistics l and m, ``2 * B * H * N * 4`` (always float32);
    * ``output_memory``: O, ``B * H * N * D * e``;
    * ``total_memory``: the sum of the three; ``total_memory_mb``: the same in MiB.

    No ``N x N`` term: the score matrix only ever exists one tile at a time, in shared memory.
    """
    for name, value in (("batch_size", batch_size), ("num_heads", num_heads), ("seq_len", seq_len),
                        ("head_dim", head_dim)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    _check_flag(use_half, "use_half")
    e = 2 if use_half else 4
    rows = int(batch_size) * int(num_heads) * int(seq_len)
    input_memory = 3 * rows * int(head_dim) * e
    internal_memory = 2 * rows * 4
    output_memory = rows * int(head_dim) * e
    total = input_memory + internal_memory + output_memory
    return {
        "input_memory": input_memory,
        "internal_memory": internal_memory,
        "output_memory": output_memory,
        "total_memory": total,
        "total_memory_mb": total / (1024 * 1024),
    }
