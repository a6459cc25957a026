"""FlashAttention's C++ entry points (PyTorch's ``flash_api.h``) on every engine.

``mha_fwd``, ``mha_varlen_fwd``, ``mha_bwd`` and ``mha_varlen_bwd`` take the positional arguments
of ``pytorch_flash::mha_*`` (with ``softcap`` after ``window_size_right``, as in current
FlashAttention 2) and return the same tuples. Each call becomes one ``AttnProblem`` in the
``"bshd"`` layout (varlen calls: a padded batch with a ``Padding`` mask) and runs on the engine the
dispatcher selects: cuDNN where it can express the call, otherwise the torch engine.

FlashAttention semantics (``S_q``/``S_k`` the lengths of one sequence):

* causal is aligned bottom-right: query ``i`` sees keys ``j <= i + S_k - S_q``. Windows are
  inclusive, ``i + S_k - S_q - left <= j <= i + S_k - S_q + right``; a negative size is
  unbounded. As FlashAttention does, a window ``>= S_k`` (``max_seqlen_k`` for varlen) becomes
  unbounded and ``is_causal`` sets ``window_size_right = 0``.
* ``alibi_slopes_`` (``[H]`` or ``[B, H]``, float32 or float64) adds
  ``-slope * |i + S_k - S_q - j|``. ``softcap > 0`` maps scores to ``softcap * tanh(s / softcap)``
  before ALiBi. GQA: ``H_q % H_k == 0``, query head ``h`` reads kv head ``h // (H_q // H_k)``.
* ``p_dropout`` is the probability of dropping an attention weight; kept weights scale by
  ``1 / (1 - p_dropout)``. Softcap with dropout is allowed here (FlashAttention refuses it).

Conventions of this implementation (where FlashAttention leaves room or differs):

* ``q_padded``, ``k_padded``, ``v_padded`` are the inputs themselves: no engine needs the head
  dim padded to a multiple of 8, so nothing is padded (any head dim works; ``D_v`` may differ
  from ``D_qk``).
* ``softmax_lse`` is float32 (float64 for float64 inputs), ``[B, H, S_q]``; varlen: ``[H,
  total_q]``. A row that sees no key gets ``out = 0`` and ``lse = -inf`` (FlashAttention writes
  ``+inf``); the backward accepts either.
* ``philox_seed`` / ``philox_offset`` are 0-d int64 CPU tensors: the call's dropout stream
  (``DropoutState``), drawn from ``gen_`` (or the default CPU generator). Every engine derives its
  keep masks from these two numbers alone, so ``mha_bwd`` regenerates exactly the forward's keep
  mask from them (pass them back unchanged). Without dropout both are 0.
* ``return_softmax`` works with or without dropout and returns ``p`` ``[B, H, S_q, S_k]`` in q's
  dtype (varlen: ``[B, H, max_seqlen_q, max_seqlen_k]``, zero past each sequence): the attention
  weights *after dropout*, i.e. dropped entries are 0 and kept ones are scaled by
  ``1 / (1 - p_dropout)``, so ``out = p @ v`` exactly. (FlashAttention returns the pre-dropout
  weights with dropped entries negated, padded to multiples of 128.) The weights come from the same
  engine call as ``out`` (the identity is appended to ``v``), so they cost ``S_k`` extra value
  columns: a testing aid, as in FlashAttention. Without it ``p`` is an empty tensor.
* ``softmax_d`` (the backward's fourth result) is ``rowsum(dout * out)``, ``[B, H, S_q]``
  (varlen ``[H, total_q]``), in the lse dtype.
* Output buffers ``out_``, ``dq_``, ``dk_``, ``dv_`` are written and returned.
* ``softmax_scale`` may be ``None`` for FlashAttention's default ``head_size ** -0.5``.
* ``deterministic`` asks for a deterministic backward (as does
  ``torch.use_deterministic_algorithms(True)``). With dropout the backward must run on the engine
  that made the mask: if that engine has no deterministic backward for the call,
  ``NotSupportedError`` says so.
* ``zero_tensors`` (varlen) is accepted; every element of the results is written anyway.
* Paged KV (``block_table_``): any page size; pages are gathered into a padded batch, so every
  engine runs it. ``cu_seqlens_k`` gives the key lengths (``seqused_k`` overrides them).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from ... import dispatch
from ...dispatch import NotSupportedError
from ...masks import Alibi, Causal, SlidingWindow
from ...problem import AttnProblem
from ...runtime import DropoutState, Inputs
from ...varlen import _cu_lengths, _gather_pages, _index_tensor, _pad, _slots, _tensor, _with_padding

__all__ = ["mha_fwd", "mha_varlen_fwd", "mha_bwd", "mha_varlen_bwd"]



# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------

def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _window(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (-1: unbounded), got {value!r}")
    return max(int(value), -1)


def _real(name: str, value, ok, bound: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not ok(value):
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The scalar arguments every ``mha_*`` takes, validated."""

    p_dropout: float
    scale: float
    causal: bool
    left: int
    right: int
    softcap: float | None

    @staticmethod
    def of(head_size, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
           softcap) -> _Options:
        scale = head_size ** -0.5 if softmax_scale is None else \
            _real("softmax_scale", softmax_scale, lambda x: True, "")
        return _Options(_real("p_dropout", p_dropout, lambda x: 0 <= x < 1, " in [0, 1)"), scale,
                        _flag("is_causal", is_causal),
                        _window("window_size_left", window_size_left),
                        _window("window_size_right", window_size_right),
                        _real("softcap", softcap, lambda x: x >= 0, " >= 0") or None)


def _like(name: str, t, shape: tuple, ref: torch.Tensor, *, optional=False, any_float=False):
    """``t`` is a tensor of ``shape`` on ``ref``'s device with ``ref``'s dtype (any float dtype
    with ``any_float``); ``None`` passes when ``optional`` (an output buffer)."""
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor):
        kind = "None or a torch.Tensor" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if any_float and not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if not any_float and t.dtype != ref.dtype:
        raise TypeError(f"{name} must have q's dtype {ref.dtype}, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on q's device {ref.device}, got {t.device}")
    return t


def _generator(gen_):
    if gen_ is not None and not isinstance(gen_, torch.Generator):
        raise TypeError(f"gen_ must be None or a torch.Generator, got {type(gen_).__name__}")
    return gen_


def _same_dtype(q, k, v) -> None:
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, "
                        f"v={v.dtype}")


def _alibi(slopes, batch: int, heads: int, device):
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes_ must be None or a torch.Tensor, got "
                        f"{type(slopes).__name__}")
    if slopes.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"alibi_slopes_ must be float32 (or float64), got {slopes.dtype}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes_ must have shape [{heads}] or [{batch}, {heads}] "
                         f"(num_heads or batch_size x num_heads), got {tuple(slopes.shape)}")
    if slopes.device != device and slopes.device.type != "cpu":
        raise ValueError(f"alibi_slopes_ must be on q's device {device}, got {slopes.device}")
    return Alibi(slopes.detach())


def _seed_arg(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a one-element integer tensor (as mha_fwd returns), "
                             f"got {value.dtype} of shape {tuple(value.shape)}")
        value = int(value.reshape(()).item())
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int64 tensor from mha_fwd, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (as mha_fwd returns), got {value}")
    return int(value)


def _philox(philox_seed, philox_offset) -> DropoutState:
    """The dropout stream ``mha_fwd`` returned, as the engines' ``DropoutState``."""
    return DropoutState(_seed_arg("philox_seed", philox_seed),
                        _seed_arg("philox_offset", philox_offset))


# ---------------------------------------------------------------------------------------------
# masks, problems, engines
# ---------------------------------------------------------------------------------------------

def _fa_mask(opts: _Options, seq_k: int, aligned_equal: bool, alibi: bool):
    """FlashAttention's causal/window arguments as a mask, after its own normalization.

    ``aligned_equal``: every sequence has as many queries as keys, so bottom-right equals
    top-left; top-left is then used (cuDNN combines it with more features).
    """
    left = -1 if opts.left >= seq_k else opts.left
    right = -1 if opts.right >= seq_k else opts.right
    if opts.causal:
        right = 0
    alignment = "top_left" if aligned_equal else "bottom_right"
    if left < 0 and right < 0:
        # No mask, but ALiBi is aligned bottom-right all the same: an unbounded window carries
        # the alignment.
        return SlidingWindow(-1, -1, alignment) if alibi and not aligned_equal else None
    if left < 0 and right == 0:
        return Causal(alignment)
    return SlidingWindow(left, right, alignment)


def _problem(q, k, v, mask, alibi, opts: _Options) -> AttnProblem:
    return AttnProblem.from_tensors(q, k, v, mask=mask, bias=alibi, scale=opts.scale,
                                    dropout_p=opts.p_dropout, softcap=opts.softcap,
                                    layout="bshd", return_lse=True)


def _dropout_engine(problem: AttnProblem):
    """The engine that makes (forward) and replays (backward) the dropout mask of ``problem``:
    selected as for a call that will run backward, whatever the deterministic setting, so both
    directions pick the same one."""
    probe = dataclasses.replace(problem, requires_grad=True, deterministic=False)
    return dispatch.select(probe), probe


def _forward(q, k, v, mask, alibi, opts: _Options, return_softmax, gen_):
    """bshd q/k/v -> ``(out, lse, dropout state, probs or None)`` on the selected engine."""
    problem = _problem(q, k, v, mask, alibi, opts)
    dropout = DropoutState(0, 0)
    if opts.p_dropout > 0:
        dropout = DropoutState.draw(gen_)
        backend, problem = _dropout_engine(problem)
    else:
        backend = dispatch.select(problem)
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    with torch.no_grad():
        if not return_softmax:
            out, lse = backend.plan(problem).forward(problem, inputs)
            return out, lse, dropout, None
        # One call computes out and the weights: p @ [v | I] = [out | p].
        seq_k, dim_v = k.shape[1], v.shape[3]
        eye = torch.eye(seq_k, dtype=v.dtype, device=v.device)
        v_aug = torch.cat([v, eye[None, :, None, :].expand(v.shape[0], seq_k, v.shape[2], seq_k)],
                          dim=-1)
        aug = _problem(q, k, v_aug, mask, alibi, opts)
        if opts.p_dropout > 0:
            reasons = backend.supports(aug)
            if reasons:  # the weights must come from the engine that replays the mask
                why = ("return_softmax with dropout appends the identity to v (D_v + S_k "
                       f"columns) and must run on {backend.name!r}, the engine that replays the "
                       "dropout mask in mha_bwd")
                raise NotSupportedError(aug, {backend.name: [why, *reasons]}, forced=backend.name)
        else:
            backend = dispatch.select(aug)
        inputs.v = v_aug
        out_aug, lse = backend.plan(aug).forward(aug, inputs)
    return out_aug[..., :dim_v], lse, dropout, out_aug[..., dim_v:].permute(0, 2, 1, 3)


def _backward(dout, q, k, v, out, lse, mask, alibi, opts: _Options, deterministic, dropout):
    """bshd tensors -> ``(dq, dk, dv)`` through the selected engine's backward."""
    problem = _problem(q, k, v, mask, alibi, opts)
    problem = dataclasses.replace(
        problem, requires_grad=True,
        deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
    if opts.p_dropout > 0:
        backend, _ = _dropout_engine(problem)
        reasons = backend.supports(problem)
        if reasons:
            why = f"the dropout mask was made by {backend.name!r}, so its backward must run there"
            raise NotSupportedError(problem, {backend.name: [why, *reasons]}, forced=backend.name)
    else:
        backend = dispatch.select(problem)
    plan = backend.plan(problem)
    # Rows that see no key: FlashAttention writes +inf, the engines take -inf.
    lse = lse.masked_fill(lse == math.inf, -math.inf)
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    with torch.no_grad():
        dq, dk, dv, _ = plan.backward(problem, inputs, out, lse, dout)
    return dq, dk, dv


def _seed_tensors(dropout: DropoutState):
    return (torch.tensor(dropout.seed, dtype=torch.int64),
            torch.tensor(dropout.offset, dtype=torch.int64))


def _into(buf, value: torch.Tensor) -> torch.Tensor:
    if buf is None:
        return value.contiguous()
    buf.copy_(value)
    return buf


def _softmax_d(dout, out, dtype) -> torch.Tensor:
    """``rowsum(dout * out)`` in the lse dtype (float32; float64 for float64 inputs)."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return (dout.to(dtype) * out.to(dtype)).sum(-1)


def _dense_qkv(q, k, v):
    return (_tensor("q", q, 4, "[batch_size, seqlen_q, num_heads, head_size]"),
            _tensor("k", k, 4, "[batch_size, seqlen_k, num_heads_k, head_size]"),
            _tensor("v", v, 4, "[batch_size, seqlen_k, num_heads_k, head_size_v]"))


# ---------------------------------------------------------------------------------------------
# dense batches
# ---------------------------------------------------------------------------------------------

def mha_fwd(q, k, v, out_, alibi_slopes_, p_dropout, softmax_scale, is_causal, window_size_left,
            window_size_right, softcap, return_softmax, gen_):
    """FlashAttention forward on ``[B, S, H, D]`` tensors.

    Returns ``(out, q_padded, k_padded, v_padded, softmax_lse, philox_seed, philox_offset, p)``:
    out ``[B, S_q, H, D_v]`` (``out_`` when given), the inputs, lse ``[B, H, S_q]``, the dropout
    seed/offset for ``mha_bwd``, and the post-dropout weights ``[B, H, S_q, S_k]`` when
    ``return_softmax`` (else an empty tensor). See the module docstring for the conventions.
    """
    q, k, v = _dense_qkv(q, k, v)
    batch, seq_q, heads, _ = q.shape
    opts = _Options.of(q.shape[3], p_dropout, softmax_scale, is_causal, window_size_left,
                       window_size_right, softcap)
    mask = _fa_mask(opts, k.shape[1], seq_q == k.shape[1], alibi_slopes_ is not None)
    return_softmax = _flag("return_softmax", return_softmax)
    gen_ = _generator(gen_)
    alibi = _alibi(alibi_slopes_, batch, heads, q.device)
    _like("out_", out_, (batch, seq_q, heads, v.shape[3]), q, optional=True)

    out, lse, dropout, probs = _forward(q, k, v, mask, alibi, opts, return_softmax, gen_)
    p = probs.contiguous() if probs is not None else q.new_empty(0)
    return (_into(out_, out), q, k, v, lse.contiguous(), *_seed_tensors(dropout), p)


def mha_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes_, p_dropout,
            softmax_scale, is_causal, window_size_left, window_size_right, softcap,
            deterministic, philox_seed, philox_offset):
    """FlashAttention backward on ``[B, S, H, D]`` tensors: ``(dq, dk, dv, softmax_d)``.

    Takes the forward's arguments, its ``out`` and ``softmax_lse``, and its ``philox_seed`` /
    ``philox_offset`` (the same dropout mask is regenerated). ``dq_``/``dk_``/``dv_`` are written
    and returned when given. ``softmax_d = rowsum(dout * out)``, ``[B, H, S_q]``.
    """
    q, k, v = _dense_qkv(q, k, v)
    _same_dtype(q, k, v)
    batch, seq_q, heads, _ = q.shape
    o_shape = (batch, seq_q, heads, v.shape[3])
    out, dout = _like("out", out, o_shape, q), _like("dout", dout, o_shape, q)
    lse = _like("softmax_lse", softmax_lse, (batch, heads, seq_q), q, any_float=True)
    bufs = [_like(n, b, t.shape, q, optional=True)
            for n, b, t in (("dq_", dq_, q), ("dk_", dk_, k), ("dv_", dv_, v))]
    opts = _Options.of(q.shape[3], p_dropout, softmax_scale, is_causal, window_size_left,
                       window_size_right, softcap)
    mask = _fa_mask(opts, k.shape[1], seq_q == k.shape[1], alibi_slopes_ is not None)
    deterministic = _flag("deterministic", deterministic)
    alibi = _alibi(alibi_slopes_, batch, heads, q.device)
    dropout = _philox(philox_seed, philox_offset)

    grads = _backward(dout, q, k, v, out, lse, mask, alibi, opts, deterministic, dropout)
    softmax_d = _softmax_d(dout, out, q.dtype).permute(0, 2, 1).contiguous()
    return (*(_into(b, g) for b, g in zip(bufs, grads)), softmax_d)


# ---------------------------------------------------------------------------------------------
# packed (varlen) batches
# ---------------------------------------------------------------------------------------------

class _Packing:
    """Lengths and padded-slot tables of a packed batch: ``[total, H, D]`` <-> ``[B, S, H, D]``."""

    def __init__(self, lens_q, lens_k, max_seqlen_q, max_seqlen_k, device):
        self.lens_q, self.lens_k = lens_q, lens_k
        self.batch = len(lens_q)
        for name, value, lens in (("max_seqlen_q", max_seqlen_q, lens_q),
                                  ("max_seqlen_k", max_seqlen_k, lens_k)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < max(lens):
                raise ValueError(f"{name} must be >= the longest sequence ({max(lens)}), got "
                                 f"{value}")
        self.max_q, self.max_k = int(max_seqlen_q), int(max_seqlen_k)
        # The engines need non-empty axes: an all-empty side pads to one slot Padding hides.
        self.seq_q, self.seq_k = max(self.max_q, 1), max(self.max_k, 1)
        self.slots_q = _slots(lens_q, self.seq_q, device)
        self.slots_k = _slots(lens_k, self.seq_k, device)

    def mask(self, opts: _Options, alibi: bool):
        fa = _fa_mask(opts, self.max_k, self.lens_q == self.lens_k, alibi)
        return _with_padding(fa, self.lens_q, self.lens_k, self.seq_q, self.seq_k)

    def pad_q(self, x):
        return _pad(x, self.lens_q, self.seq_q, self.slots_q)

    def pad_k(self, x):
        return _pad(x, self.lens_k, self.seq_k, self.slots_k)

    def unpad(self, x, slots):
        return x.reshape(-1, *x.shape[2:]).index_select(0, slots)

    def lse_packed(self, lse):
        """[B, H, S] -> FlashAttention 2's varlen [H, total_q]."""
        heads = lse.shape[1]
        return lse.permute(1, 0, 2).reshape(heads, -1).index_select(1, self.slots_q)

    def lse_padded(self, lse):
        """[H, total_q] -> [B, H, S] with -inf in the padding rows."""
        heads = lse.shape[0]
        full = lse.new_full((heads, self.batch * self.seq_q), -math.inf)
        full[:, self.slots_q] = lse
        return full.view(heads, self.batch, self.seq_q).permute(1, 0, 2)


def _varlen_heads(q, k, v, paged: bool):
    q = _tensor("q", q, 3, "[total_q, num_heads, head_size]")
    if paged:
        what = "[num_blocks, page_block_size, num_heads_k, head_size{}] (paged, with block_table_)"
        k = _tensor("k", k, 4, what.format(""))
        v = _tensor("v", v, 4, what.format("_v"))
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k and v must have the same pages, page size and heads, got "
                             f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    else:
        k = _tensor("k", k, 3, "[total_k, num_heads_k, head_size] (or 4-D pages with "
                    "block_table_)")
        v = _tensor("v", v, 3, "[total_k, num_heads_k, head_size_v]")
        if k.shape[:2] != v.shape[:2]:
            raise ValueError(f"k and v must have the same tokens and heads, got "
                             f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head size must equal q head size, got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}")
    if q.shape[1] % max(k.shape[-2], 1):
        raise ValueError(f"num_heads must be a multiple of num_heads_k (GQA/MQA), got "
                         f"{q.shape[1]} and {k.shape[-2]}")
    return q, k, v


def _cu_total(cu) -> int:
    """``cu[-1]`` where it can be read (the paged cache has no packed key axis to check)."""
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() and \
            not cu.dtype.is_floating_point:
        return int(cu[-1])
    return 0


def _fit(x: torch.Tensor, seq: int) -> torch.Tensor:
    """Dim 1 cut or zero-padded to ``seq``."""
    if x.shape[1] >= seq:
        return x[:, :seq]
    pad = x.new_zeros(x.shape[0], seq - x.shape[1], *x.shape[2:])
    return torch.cat([x, pad], dim=1)


def _hide_past(x: torch.Tensor, lens) -> torch.Tensor:
    """Zero the slots past each length: they may hold anything (NaN included), and a hidden key's
    weight is 0 but ``0 * NaN`` is not."""
    past = torch.arange(x.shape[1], device=x.device)[None, :] >= \
        torch.tensor(lens, device=x.device)[:, None]
    return x.masked_fill(past[:, :, None, None], 0)


def _varlen_keys(k, v, lens_k, full_k, table, pack):
    """Each sequence's keys/values as a padded ``[B, S_k, H_k, D]`` batch (paged caches
    gathered, keys past ``seqused_k`` left out)."""
    if table is not None:
        pages = _gather_pages(k, v, table, lens_k)
        return tuple(_hide_past(_fit(x, pack.seq_k), lens_k) for x in pages)
    if lens_k != full_k:  # only the first seqused_k[b] keys of each sequence
        starts = torch.tensor([0, *full_k[:-1]]).cumsum(0).tolist()
        index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens_k)]).to(k.device)
        k, v = k.index_select(0, index), v.index_select(0, index)
    return pack.pad_k(k), pack.pad_k(v)


def _used_lengths(seqused_k, lens_k, paged: bool, device) -> list[int]:
    used = _index_tensor("seqused_k", seqused_k, 1, device).tolist()
    if len(used) != len(lens_k):
        raise ValueError(f"seqused_k must have one entry per sequence ({len(lens_k)}), got "
                         f"{len(used)}")
    for b, (n, cap) in enumerate(zip(used, lens_k)):
        if n < 0 or (not paged and n > cap):
            raise ValueError(f"seqused_k[{b}] = {n} must be in [0, {cap}] (the keys of "
                             f"sequence {b} in cu_seqlens_k)")
    return used


def _block_table(block_table_, lens_k, page: int, device) -> torch.Tensor:
    table = _index_tensor("block_table_", block_table_, 2, device)
    if table.shape[0] != len(lens_k):
        raise ValueError(f"block_table_ must have one row per sequence ({len(lens_k)}), got "
                         f"shape {tuple(table.shape)}")
    capacity = table.shape[1] * page
    for b, n in enumerate(lens_k):
        if n > capacity:
            raise ValueError(f"sequence {b} has {n} keys but block_table_ holds "
                             f"{table.shape[1]} pages of {page} tokens ({capacity})")
    return table


def _batch_lengths(q, k, cu_seqlens_q, cu_seqlens_k, paged: bool):
    lens_q = _cu_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q", q.device)
    # A paged cache has no packed key axis: cu_seqlens_k only gives the lengths.
    total_k = _cu_total(cu_seqlens_k) if paged else k.shape[0]
    lens_k = _cu_lengths("cu_seqlens_k", cu_seqlens_k, total_k, "k", q.device)
    if len(lens_k) != len(lens_q):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got "
                         f"{len(lens_q)} and {len(lens_k)} sequences")
    return lens_q, lens_k


def mha_varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table_,
                   alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
                   zero_tensors, is_causal, window_size_left, window_size_right, softcap,
                   return_softmax, gen_):
    """FlashAttention forward on packed sequences (``[total, H, D]`` with ``cu_seqlens``).

    ``seqused_k`` (int ``[B]``) limits each sequence's keys to its first ``seqused_k[b]``.
    ``block_table_`` (int ``[B, max_blocks]``) makes ``k``/``v`` paged caches ``[num_blocks,
    page_size, H_k, D]`` of any page size: key ``t`` of sequence ``b`` is row ``t % page_size`` of
    page ``block_table_[b, t // page_size]``; the key lengths are ``cu_seqlens_k``'s (or
    ``seqused_k``). Returns ``(out [total_q, H, D_v], q, k, v, softmax_lse [H, total_q],
    philox_seed, philox_offset, p [B, H, max_seqlen_q, max_seqlen_k] or empty)``.
    """
    paged = block_table_ is not None
    q, k, v = _varlen_heads(q, k, v, paged)
    lens_q, full_k = _batch_lengths(q, k, cu_seqlens_q, cu_seqlens_k, paged)
    lens_k = full_k if seqused_k is None else _used_lengths(seqused_k, full_k, paged, q.device)
    table = _block_table(block_table_, lens_k, k.shape[1], q.device) if paged else None
    pack = _Packing(lens_q, lens_k, max_seqlen_q, max_seqlen_k, q.device)
    opts = _Options.of(q.shape[-1], p_dropout, softmax_scale, is_causal, window_size_left,
                       window_size_right, softcap)
    _flag("zero_tensors", zero_tensors)
    mask = pack.mask(opts, alibi_slopes_ is not None)
    return_softmax = _flag("return_softmax", return_softmax)
    gen_ = _generator(gen_)
    alibi = _alibi(alibi_slopes_, pack.batch, q.shape[1], q.device)
    _like("out_", out_, (q.shape[0], q.shape[1], v.shape[-1]), q, optional=True)

    kp, vp = _varlen_keys(k, v, lens_k, full_k, table, pack)
    out, lse, dropout, probs = _forward(pack.pad_q(q), kp, vp, mask, alibi, opts, return_softmax,
                                     gen_)
    p = q.new_empty(0)
    if probs is not None:
        p = probs[:, :, :pack.max_q, :pack.max_k].contiguous()
    return (_into(out_, pack.unpad(out, pack.slots_q)), q, k, v, pack.lse_packed(lse),
            *_seed_tensors(dropout), p)


def mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k,
                   alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
                   zero_tensors, is_causal, window_size_left, window_size_right, softcap,
                   deterministic, philox_seed, philox_offset):
    """FlashAttention backward on packed sequences: ``(dq, dk, dv, softmax_d)``.

    The arguments of ``mha_varlen_fwd`` (without ``seqused_k`` and paging, as FlashAttention),
    its ``out``, ``softmax_lse`` ``[H, total_q]`` and ``philox_seed``/``philox_offset``.
    ``softmax_d = rowsum(dout * out)`` as ``[H, total_q]``.
    """
    q, k, v = _varlen_heads(q, k, v, False)
    _same_dtype(q, k, v)
    o_shape = (q.shape[0], q.shape[1], v.shape[-1])
    out, dout = _like("out", out, o_shape, q), _like("dout", dout, o_shape, q)
    lse = _like("softmax_lse", softmax_lse, (q.shape[1], q.shape[0]), q, any_float=True)
    bufs = [_like(n, b, t.shape, q, optional=True)
            for n, b, t in (("dq_", dq_, q), ("dk_", dk_, k), ("dv_", dv_, v))]
    lens_q, lens_k = _batch_lengths(q, k, cu_seqlens_q, cu_seqlens_k, False)
    pack = _Packing(lens_q, lens_k, max_seqlen_q, max_seqlen_k, q.device)
    opts = _Options.of(q.shape[-1], p_dropout, softmax_scale, is_causal, window_size_left,
                       window_size_right, softcap)
    _flag("zero_tensors", zero_tensors)
    mask = pack.mask(opts, alibi_slopes_ is not None)
    deterministic = _flag("deterministic", deterministic)
    alibi = _alibi(alibi_slopes_, pack.batch, q.shape[1], q.device)
    dropout = _philox(philox_seed, philox_offset)

    grads = _backward(pack.pad_q(dout), pack.pad_q(q), pack.pad_k(k), pack.pad_k(v),
                      pack.pad_q(out), pack.lse_padded(lse), mask, alibi, opts, deterministic,
                      dropout)
    slots = (pack.slots_q, pack.slots_k, pack.slots_k)
    softmax_d = _softmax_d(dout, out, q.dtype).t().contiguous()
    return (*(_into(b, pack.unpad(g, s)) for b, g, s in zip(bufs, grads, slots)), softmax_d)
