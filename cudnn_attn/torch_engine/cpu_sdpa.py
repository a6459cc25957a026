"""PyTorch's SDPA CPU kernel, used wherever it computes exactly what we would.

Two uses: a whole problem (no mask or plain causal), and batches of tiles, where the tile's
visibility, bias and ALiBi arrive as one additive float mask. The kernel runs the softmax in cache
blocks, several times faster than composing it from elementwise ops.
"""

from __future__ import annotations

import math

import torch

from .layouts import lse_dtype
from .segments import add_at
from ..model.checks import default_scale
from ..model.masks import Causal, mask_parts, same_alignment
from ..model.problem import AttnProblem


def whole_problem_ok(problem: AttnProblem) -> bool:
    if problem.device.type != "cpu" or problem.dim_qk != problem.dim_v:
        return False
    if (problem.bias or problem.alibi or problem.rpb or problem.softcap or problem.dropout_p
            or problem.dropout_mask or problem.score_mod):
        return False
    parts = mask_parts(problem.mask)
    if not parts:
        return True
    if len(parts) == 1 and isinstance(parts[0], Causal):
        return same_alignment(parts[0].alignment, problem.seq_q == problem.seq_kv) == "top_left"
    return False


def whole_problem_scale_ok(problem: AttnProblem) -> bool:
    """Whether this call's scale (a runtime value, not in the plan key) suits the causal kernel:
    it hides keys before scaling, so a scale <= 0 turns a hidden -inf into +inf or NaN."""
    return problem.mask is None or problem.scale > 0


def whole_problem(problem, q, k, v, need_lse=True):
    if not need_lse and problem.heads_q == problem.heads_kv:
        # The public op reaches the same kernel with less call overhead (tiny decode calls).
        return out_only(problem)(q, k, v), None
    if problem.layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    # The kernel reads rows with a unit stride and trusts its caller on that.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, problem.mask is not None, scale=problem.scale)
    if problem.layout == "bshd":
        out = out.transpose(1, 2)
    return out, lse.to(lse_dtype(problem.dtype))


def whole_backward(problem, q, k, v, out, lse, dout):
    """``(dq, dk, dv, None)`` of a ``whole_problem`` (``H_q == H_kv``, no lse gradient) through
    the fused kernel's own backward, from its forward's out and lse."""
    tensors = (q, k, v, out, dout)
    if problem.layout == "bshd":
        tensors = tuple(t.transpose(1, 2) for t in tensors)
    q, k, v, out, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in tensors)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(torch.float32 if q.dtype != torch.float64 else q.dtype), 0.0,
        problem.mask is not None, scale=problem.scale)
    if problem.layout == "bshd":
        grads = tuple(g.transpose(1, 2) for g in grads)
    return (*grads, None)


def out_only(problem):
    """``(q, k, v) -> out`` of a whole problem without the lse, through the public SDPA op (for
    ``whole_problem_ok`` problems with ``H_q == H_kv``); callers may keep it per problem."""
    causal = problem.mask is not None
    # SDPA's own default is the same D ** -0.5; not passing it saves a little per call.
    scale = None if problem.scale == default_scale(problem.dim_qk) else problem.scale
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if problem.layout == "bshd":
        def run(q, k, v):
            return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                        scale=scale).transpose(1, 2)
    elif causal or scale is not None:
        def run(q, k, v):
            return sdpa(q, k, v, is_causal=causal, scale=scale)
    else:
        run = sdpa  # the plain call: not even a wrapper
    return run


# ---------------------------------------------------------------------------------------------
# Batches of tiles
# ---------------------------------------------------------------------------------------------

def tiles_ok(problem: AttnProblem) -> bool:
    """The kernel needs one head dim for q/k/v and knows no softcap or replayable dropout."""
    return (problem.device.type == "cpu" and problem.dim_qk == problem.dim_v
            and problem.softcap is None and problem.dropout_p == 0
            and problem.dropout_mask is None and problem.score_mod is None)


def _operands(plan, problem, tensors, lo, hi):
    """Per-chunk kernel operands: gathered rows ``[BH, n, T*G, X]`` of each query-like tensor,
    keys/values ``[BH, n, W, X]``, the additive mask, and the rows that see no key."""
    queries, k3, v3 = tensors[:3]
    t = plan.tiles
    device = k3.device
    B, Hkv, G, n, T = problem.batch, problem.heads_kv, problem.group_size, hi - lo, t.size
    BH = B * Hkv
    keys = plan.keys_of(lo, hi, device)
    rows_idx = t.on(device).q_idx[lo:hi].reshape(-1)
    gathered = [x.index_select(1, rows_idx).view(BH, n, T * G, -1) for x in queries]
    if t.k_idx is None:
        # Every tile reads all keys: fold the tiles into one long row block instead.
        gathered = [x.view(BH, 1, n * T * G, -1) for x in gathered]
        kg, vg = k3[:, None], v3[:, None]
    else:
        flat = keys.reshape(-1)
        kg = k3.index_select(1, flat).view(BH, n, t.num_keys, -1)
        vg = v3.index_select(1, flat).view(BH, n, t.num_keys, -1)
    cache, cache_key = plan.additive_masks, (lo, hi, k3.dtype, device)
    if cache is not None and cache_key in cache:
        return (gathered, kg, vg, *cache[cache_key])
    hidden = plan.hidden_of(problem, lo, hi, keys, device)
    extra = plan.bias_of(problem, None if len(tensors) < 4 else tensors[3], lo, hi, keys, device,
                         k3.dtype)
    mask, empty = _additive_mask(problem, hidden, extra, n, T, t.num_keys, k3.dtype)
    if t.k_idx is None and mask is not None:
        mask = mask.reshape(mask.shape[0], 1, n * T * G, -1)
    if cache is not None:
        cache[cache_key] = (mask, empty)
    return gathered, kg, vg, mask, empty


def _additive_mask(problem, hidden, extra, n, T, W, dtype):
    """One float mask broadcastable to [BH, n, T*G, W] (0 / -inf plus biases), and the
    [BH|1, n, T*G] rows with no finite score (or None)."""
    B, Hkv, G = problem.batch, problem.heads_kv, problem.group_size
    if hidden is None and extra is None:
        return None, None
    mask = torch.zeros((), dtype=dtype, device=(hidden if extra is None else extra).device)
    if extra is not None:
        mask = mask + extra
    if hidden is not None:
        # Hiding replaces the biased score: a NaN or +inf bias at a hidden pair stays hidden.
        mask = torch.where(hidden[:, None, :, :, None, :], -math.inf, mask)
    b, h = mask.shape[0], mask.shape[1]
    if b == 1 and h == 1:
        mask = mask.expand(1, 1, n, T, G, W).reshape(1, n, T * G, W)
    else:
        mask = mask.expand(B, Hkv, n, T, G, W).reshape(B * Hkv, n, T * G, W)
    # A row whose every score is -inf (mask or bias) must give out 0 and lse -inf.
    empty = (mask == -math.inf).all(-1)
    return mask, (empty if bool(empty.any()) else None)


def tile_forward(plan, problem, q, k, v, bias):
    """Forward through the fused kernel, one chunk of tiles per call."""
    from .layouts import cols, compute_dtype, lse_layout, rows_of, unrows

    dtype = compute_dtype(problem.dtype)
    q3, k3, v3 = rows_of(problem, q, dtype), cols(problem, k, dtype), cols(problem, v, dtype)
    BH, G, T = problem.batch * problem.heads_kv, problem.group_size, plan.tiles.size
    rows = plan.tiles.count * T
    out_t = q3.new_empty(BH, rows, G, problem.dim_v)
    lse_t = q3.new_empty(BH, rows, G)
    tensors = ((q3,), k3, v3) + (() if bias is None else (bias,))
    for lo, hi in plan.chunks(problem):
        n = hi - lo
        (qg,), kg, vg, mask, empty = _operands(plan, problem, tensors, lo, hi)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, kg, vg, 0.0, False, attn_mask=mask, scale=problem.scale)
        if empty is not None:
            empty = empty.view(empty.shape[0], n, T * G)
            # The kernel reports 0 for the LSE of a row that sees nothing; it is -inf.
            lse = lse.view(BH, n, T * G).masked_fill(empty, -math.inf)
            out = out.view(BH, n, T * G, -1).masked_fill(empty[..., None], 0.0)
        out_t[:, lo * T:hi * T] = out.reshape(BH, n * T, G, -1)
        lse_t[:, lo * T:hi * T] = lse.reshape(BH, n * T, G)
    inverse = plan.tiles.on(q3.device).inverse
    out = unrows(problem, out_t.index_select(1, inverse)).to(problem.dtype)
    return out, lse_layout(problem, lse_t.index_select(1, inverse)).to(lse_dtype(problem.dtype))


def tile_backward(plan, problem, q, k, v, bias, out, lse, dout):
    """Backward through the fused kernel's backward, from the saved LSE."""
    from .layouts import cols, compute_dtype, lse_rows, rows_of, uncols, unrows

    dtype = compute_dtype(problem.dtype)
    B, Hkv, G, T = problem.batch, problem.heads_kv, problem.group_size, plan.tiles.size
    BH = B * Hkv
    queries = (rows_of(problem, q, dtype), rows_of(problem, out, dtype),
               rows_of(problem, dout, dtype),
               lse_rows(problem, lse.to(dtype)).masked_fill(lse_rows(problem, lse) == -math.inf, 0))
    k3, v3 = cols(problem, k, dtype), cols(problem, v, dtype)
    dq_t = queries[0].new_zeros(BH, plan.tiles.count * T, G * problem.dim_qk)
    dk, dv = torch.zeros_like(k3), torch.zeros_like(v3)
    tensors = (queries, k3, v3) + (() if bias is None else (bias,))
    for lo, hi in plan.chunks(problem):
        n = hi - lo
        (qg, og, dog, lseg), kg, vg, mask, _ = _operands(plan, problem, tensors, lo, hi)
        dqg, dkg, dvg = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dog, qg, kg, vg, og, lseg.reshape(qg.shape[:-1]), 0.0, False, attn_mask=mask,
            scale=problem.scale)
        dq_t[:, lo * T:hi * T] = dqg.reshape(BH, n * T, -1)
        if plan.tiles.k_idx is None:
            dk += dkg[:, 0]
            dv += dvg[:, 0]
        else:
            flat = plan.keys_of(lo, hi, k3.device).reshape(-1)
            add_at(dk, flat, dkg.reshape(BH, -1, dkg.shape[-1]))
            add_at(dv, flat, dvg.reshape(BH, -1, dvg.shape[-1]))
    dq = unrows(problem, dq_t.index_select(1, plan.tiles.on(dk.device).inverse))
    return (dq.to(problem.dtype), uncols(problem, dk).to(problem.dtype),
            uncols(problem, dv).to(problem.dtype), None)
