"""Internal tensor layouts of the torch engine.

Queries (and out, dout) are kept as ``[B*H_kv, S_q, G*X]`` with the ``G = H_q // H_kv`` query heads
of one kv head side by side, keys and values as ``[B*H_kv, S_kv, X]``: every gather then runs along
dim 1 of a contiguous 3-D tensor, which is PyTorch's fast path.
"""

from __future__ import annotations

from ..model.problem import accumulator_dtype as compute_dtype, accumulator_dtype as lse_dtype# noqa: F401


def rows_of(problem, t, dtype, scale=None):
    B, Hkv, G = problem.batch, problem.heads_kv, problem.group_size
    if problem.layout == "bhsd":
        x = t.view(B, Hkv, G, t.shape[2], -1).transpose(2, 3)
    else:
        x = t.view(B, t.shape[1], Hkv, G, -1).transpose(1, 2)
    x = x.to(dtype)
    if scale is not None:
        x = x * scale
    return x.reshape(B * Hkv, x.shape[2], -1).contiguous()


def cols(problem, t, dtype):
    x = t if problem.layout == "bhsd" else t.transpose(1, 2)
    return x.to(dtype).reshape(problem.batch * problem.heads_kv, x.shape[2], -1).contiguous()


def unrows(problem, x):
    """[B*H_kv, S, G*X] -> the call's layout with H_q heads."""
    B, Hkv, G = problem.batch, problem.heads_kv, problem.group_size
    x = x.view(B, Hkv, x.shape[1], G, -1)
    if problem.layout == "bhsd":
        return x.permute(0, 1, 3, 2, 4).reshape(B, Hkv * G, x.shape[2], -1)
    return x.reshape(B, Hkv, x.shape[2], G * x.shape[4]).permute(0, 2, 1, 3) \
        .reshape(B, x.shape[2], Hkv * G, -1)


def uncols(problem, x):
    x = x.view(problem.batch, problem.heads_kv, x.shape[1], -1)
    return x if problem.layout == "bhsd" else x.transpose(1, 2).contiguous()


def lse_layout(problem, x):
    """[B*H_kv, S_q, G] -> [B, H_q, S_q]."""
    x = x.view(problem.batch, problem.heads_kv, -1, problem.group_size)
    return x.permute(0, 1, 3, 2).reshape(problem.batch, problem.heads_q, -1)


def lse_rows(problem, x):
    """[B, H_q, S_q] -> [B*H_kv, S_q, G]."""
    x = x.view(problem.batch, problem.heads_kv, problem.group_size, -1)
    return x.permute(0, 1, 3, 2).reshape(problem.batch * problem.heads_kv, -1,
                                         problem.group_size)


