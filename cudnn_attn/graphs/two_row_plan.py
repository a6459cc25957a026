"""The plan of a repeatable single-query call on cuDNN (``decode_rows``): its graphs are built
for two query rows; the extra row is added to the inputs and dropped from the results.

The rows that see no key are the call's own row's: found for one row (a decode step's
``cache_seqlens == 0``: one comparison) and filled while the real row is copied out of the
two-row result (one ``where`` each for out and the stats, where filling both rows and then
copying cost two kernels more each).
"""

from __future__ import annotations

import math

import torch

from ..model.inputs import Inputs, scalar_zero
from ..model.problem import AttnProblem
from . import decode_rows

__all__ = ["TwoRowPlan"]


class TwoRowPlan:
    """Runs a single-query call through ``inner``, the ``CudnnPlan`` of its two-row problem
    (made with the call's own row as its ``rows``); the extra row goes ``where`` (``"front"`` /
    ``"back"``, ``decode_rows.side``)."""

    name = "cudnn"

    def __init__(self, inner, where: str):
        self.inner, self.where = inner, where

    @property
    def spec(self):
        return self.inner.spec

    def prepare(self, problem: AttnProblem) -> None:
        self.inner.prepare(decode_rows.padded_problem(problem))

    def direct(self, problem):
        """None: the extra row is added and dropped by ``forward`` and ``backward``."""
        return None

    def _two_rows(self, problem, inputs):
        q = decode_rows.add_row(inputs.q, problem.layout, self.where)
        return decode_rows.padded_problem(problem), Inputs(
            q, inputs.k, inputs.v, inputs.bias, inputs.dropout, inputs.dropout_mask)

    def forward(self, problem, inputs, need_lse=True):
        out, stats, empty = self.inner.raw_forward(*self._two_rows(problem, inputs), need_lse)
        axis = 2 if problem.layout == "bhsd" else 1
        out = self._real(out, axis)
        stats = None if stats is None else self._real(stats, 2)
        if empty is None:
            out = out.contiguous()
            stats = None if stats is None else stats.contiguous()
        else:  # the fill and the copy out of the two-row buffers in one kernel each
            out = torch.where(self._real(empty[0], axis), scalar_zero(out), out)
            if stats is not None:
                stats = torch.where(self._real(empty[1], 2), -math.inf, stats)
        s = self.spec
        return out, None if stats is None else stats.view(s.batch, s.heads_q, 1)

    def _real(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        """The real row of ``t`` on ``axis`` (``t`` itself when it has one row there: views
        made for one row broadcast)."""
        if t.shape[axis] == 1:
            return t
        return t.narrow(axis, 1 if self.where == "front" else 0, 1)

    def backward(self, problem, inputs, out, lse, dout, dlse=None):
        """The extra row: ``O = dO = 0`` and ``lse = +inf`` (its weights are 0): it adds
        nothing to dK, dV (or dBias); its dQ row is dropped."""
        layout, where, add = problem.layout, self.where, decode_rows.add_row
        dq, dk, dv, dbias = self.inner.backward(
            *self._two_rows(problem, inputs), add(out, layout, where, 0.0),
            add(lse, "", where, math.inf, rows=2), add(dout, layout, where, 0.0),
            None if dlse is None else add(dlse, "", where, 0.0, rows=2))
        return decode_rows.real_row(dq, layout, where).contiguous(), dk, dv, dbias
