"""Head dims cuDNN does not take (not multiples of ``LIMITS.head_dim_multiple``), run as
FlashAttention itself runs them: q/k/v zero-padded to the next multiple, the output and the
gradients sliced back.

Exact: the zero columns add nothing to ``q @ k^T`` (the scale stays the call's, a runtime value
fixed from the real ``D_qk``), the output's padded columns are ``p @ 0 = 0``, and the gradients
of the real columns do not involve the padded ones (``dq = ds @ k``, ``dk = ds^T @ q``,
``dv = p^T @ dout`` with ``dout`` zero-padded). The padding is copies of q/k/v (and of out and
dout in the backward): the price of running on cuDNN instead of the CuPy or torch engine.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..model.inputs import Inputs
from ..model.problem import AttnProblem, TensorSpec
from .limits import LIMITS

__all__ = ["needs_padding", "padded_problem", "HeadPadPlan"]


def _up(d: int) -> int:
    m = LIMITS.head_dim_multiple
    return -(-d // m) * m


def needs_padding(problem: AttnProblem) -> bool:
    return (_up(problem.dim_qk), _up(problem.dim_v)) != (problem.dim_qk, problem.dim_v)


def padded_problem(problem: AttnProblem) -> AttnProblem:
    """``problem`` with its head dims rounded up and its q/k/v contiguous in the call's layout
    (packed tensors stay token-major: the same strides as a contiguous ``bshd`` batch)."""
    d_qk, d_v = _up(problem.dim_qk), _up(problem.dim_v)

    def spec(t: TensorSpec, dim: int) -> TensorSpec:
        shape = (*t.shape[:3], dim)
        stride = [0, 0, 0, 1]
        for axis in (2, 1, 0):
            stride[axis] = stride[axis + 1] * shape[axis + 1]
        return TensorSpec(shape, tuple(stride), t.dtype)

    return dataclasses.replace(problem, dim_qk=d_qk, dim_v=d_v, q=spec(problem.q, d_qk),
                               k=spec(problem.k, d_qk), v=spec(problem.v, d_v))


def _pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.pad(x, (0, dim - x.shape[-1])).contiguous()


class HeadPadPlan:
    """The plan of the padded problem, with the moves in and out of every call."""

    @property
    def forward_ignores_padded_keys(self) -> bool:
        return getattr(self.inner, "forward_ignores_padded_keys", False)  # its graphs'

    def __init__(self, inner):
        self.inner = inner

    def direct(self, problem: AttnProblem):
        return None

    def _inputs(self, problem: AttnProblem, inputs: Inputs):
        padded = padded_problem(problem)
        return padded, Inputs(_pad(inputs.q, padded.dim_qk), _pad(inputs.k, padded.dim_qk),
                              _pad(inputs.v, padded.dim_v), inputs.bias, inputs.dropout,
                              inputs.dropout_mask)

    def forward(self, problem: AttnProblem, inputs: Inputs, need_lse: bool = True):
        padded, moved = self._inputs(problem, inputs)
        out, lse = self.inner.forward(padded, moved, need_lse=need_lse)
        return out[..., :problem.dim_v].contiguous(), lse

    def backward(self, problem: AttnProblem, inputs: Inputs, out, lse, dout, dlse=None):
        padded, moved = self._inputs(problem, inputs)
        dq, dk, dv, dbias = self.inner.backward(padded, moved, _pad(out, padded.dim_v), lse,
                                                _pad(dout, padded.dim_v), dlse)
        return (dq[..., :problem.dim_qk].contiguous(), dk[..., :problem.dim_qk].contiguous(),
                dv[..., :problem.dim_v].contiguous(), dbias)
