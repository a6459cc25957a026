"""Single-query calls on cuDNN that must not take its ``S_q = 1`` graphs run as two-row graphs.

cuDNN's decode path (a graph with ``S_q = 1``) is not bitwise repeatable: on an H200 (cuDNN
9.19), 200 repeats of one ``(S_q, S_kv) = (1, 239)``, D = 160, causal call gave 105-157 distinct
outputs (max difference 1.2e-4), while ``S_q = 2`` and ``S_q = 64`` gave one (issue 36). A call
that must be repeatable (``problem.deterministic``: torch's deterministic mode or FlashAttention's
``deterministic=True``; ``problem.repeatable``: every FlashAttention surface, whose forward is
bitwise repeatable) therefore runs a graph with one extra query row, and the row is discarded.
So does a single-query call with ``B = H_q = 1`` and a backward, whose one-row backward cuDNN
could not plan (the process crashed in ``create_execution_plans`` on an H200, cuDNN 9.26;
cudnn-frontend #1071): with two rows it plans, and the call stays on cuDNN.

* The extra row is a copy of the query. It goes **in front** when the mask is aligned
  bottom-right by the graph's own sizes (no padding mask: query ``i`` sits at
  ``i + S_kv - S_q``, so the real row, now row 1 of 2, keeps its place), else **behind**
  (top-left alignment or no band; with a padding mask the extra row lies past every
  ``seq_lens_q`` and sees nothing).
* Backward: the extra row gets ``dO = 0``, ``O = 0`` and ``lse = +inf`` (its weights are 0), so
  it adds nothing to dK, dV; its dQ row is dropped.

What a row index means beyond the alignment (a bias tensor or an explicit dropout mask with
``S_q`` rows, a builder's score_mod, a neighborhood, packed queries) cannot take the extra row
(ALiBi, whose ``j - i`` would move with a row in front, only combines with top-left bands on
cuDNN, where the row goes behind): ``reasons`` declines those calls, and a repeatable
engine runs them.

A FlashAttention call whose keys end at a padding mask's lengths (a KV-cache decode step) keeps
the one-row graph: ``keys_end_inside``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.caches import memoize
from ..model.masks import Causal, SlidingWindow
from ..model.problem import AttnProblem, TensorSpec
from ..model.storage import Ragged
from .limits import LIMITS

__all__ = ["needed", "keys_end_inside", "ignores_padded_keys", "one_row_unplannable", "side",
           "reasons", "cause", "padded_problem", "add_row", "real_row"]


def needed(problem: AttnProblem) -> bool:
    """Whether ``problem`` is a single-query call that must be repeatable (cuDNN's decode path
    is not), or one with a backward cuDNN cannot plan as it stands (``one_row_unplannable``).
    A FlashAttention call (``repeatable``) whose keys end at a padding mask's lengths keeps
    the one-row graph (``keys_end_inside``)."""
    return problem.seq_q == 1 and (
        problem.deterministic or problem.repeatable and not keys_end_inside(problem)
        or problem.requires_grad and one_row_unplannable(problem))


def keys_end_inside(problem: AttnProblem) -> bool:
    """Whether the keys end at lengths inside K/V (a padding mask over a dense or paged cache,
    not packed queries): the memory past them is the caller's and may hold anything, and
    FlashAttention reads nothing there. On an H200 (cuDNN 9.19) a paged decode step of
    ``flash_attn_with_kvcache`` over NaN-poisoned pages gave NaN everywhere as a two-row graph,
    where the one-row graph (``attention_with_kvcache``, the same pages) gave the oracle's
    numbers: cuDNN's S_q >= 2 kernels hide the keys past the lengths in the scores but multiply
    their V rows by P = 0 (0 * NaN; cudnn-frontend #624 and #718 describe it for its prefill
    kernels). The price: this call's bitwise repeatability is the decode graph's (issue 36)."""
    return problem.padding is not None and not isinstance(problem.storage, Ragged)


def ignores_padded_keys(spec) -> bool:
    """Whether a forward graph of ``spec`` (a ``GraphSpec``) keeps what lies past the key
    lengths out of its results by itself: cuDNN's one-row (decode) kernel does (on an H200,
    cuDNN 9.19, NaN stored past the lengths in K, V or both left a dense decode step's result
    finite and bitwise that of the zeroed cache: benchmarks/decode_rows.py's probe,
    results/cudnn-2026-11-29.json); its kernels of more rows do not (``keys_end_inside``)."""
    return spec.seq_q == 1


def one_row_unplannable(problem: AttnProblem) -> bool:
    """Whether cuDNN cannot plan ``problem``'s backward as it stands: ``B = H_q = S_q = 1``
    (planning it crashed the process: cudnn-frontend #1071), where two rows plan."""
    return (problem.batch == problem.heads_q == problem.seq_q == 1
            and not LIMITS.backward_single_row)


def side(problem: AttnProblem) -> str:
    """``"front"`` or ``"back"``: where the extra query row goes (module docstring)."""
    aligned_br = any(m.alignment == "bottom_right"
                     for m in problem.masks_of(Causal) + problem.masks_of(SlidingWindow))
    return "front" if aligned_br and problem.padding is None else "back"


def reasons(problem: AttnProblem) -> list[str]:
    """Why a call that must run as a two-row graph (``needed``) cannot (empty: it can)."""
    if not needed(problem):
        return []
    why = []
    if isinstance(problem.storage, Ragged):  # paged K/V keep a dense q: they can
        why.append("packed (ragged) queries")
    if problem.bias is not None or problem.dropout_mask is not None:
        why.append("a bias tensor or dropout mask with S_q rows")
    if problem.score_mod is not None:
        why.append("a score_mod program (it may read the row index)")
    if problem.neighborhood is not None:
        why.append("a neighborhood (S_q = S_kv)")
    if not why:
        return []
    return [f"a single-query call runs as a two-row graph where {cause(problem)}; that "
            f"graph cannot carry " + ", ".join(why)]


def cause(problem: AttnProblem) -> str:
    """Why ``problem`` (``needed``) runs as a two-row graph."""
    if problem.deterministic or problem.repeatable:
        return ("cuDNN's S_q = 1 decode path is not bitwise repeatable and the call must be "
                "(deterministic, or a FlashAttention surface; issue 36)")
    return ("planning cuDNN's S_q = 1 backward with B = H_q = 1 crashed the process "
            "(cudnn-frontend #1071)")


def _row_dim(layout: str) -> int:
    return 2 if layout == "bhsd" else 1


def padded_problem(problem: AttnProblem) -> AttnProblem:
    """``problem`` with two query rows (q contiguous in the call's layout)."""
    return problem.with_query_rows(2, _two_row_query(problem.q, problem.layout))


@memoize("decode_rows.query", 64)
def _two_row_query(q: TensorSpec, layout: str) -> TensorSpec:
    """The spec of a contiguous q with two rows in place of ``q``'s one (made once per spec:
    every decode step of a model asks for the same few)."""
    shape = list(q.shape)
    shape[_row_dim(layout)] = 2
    stride = torch.empty(shape, dtype=q.dtype, device="meta").stride()
    return TensorSpec(tuple(shape), tuple(stride), q.dtype)


def add_row(t: torch.Tensor, layout: str, where: str, fill: Optional[float] = None,
            rows: Optional[int] = None) -> torch.Tensor:
    """``t`` with the extra row at ``where``: a copy of the real row, or ``fill``. ``rows``: the
    axis of the rows when it is not the layout's (lse ``[B, H, S_q]``: 2)."""
    axis = _row_dim(layout) if rows is None else rows
    extra = t if fill is None else torch.full_like(t, fill)
    parts = (extra, t) if where == "front" else (t, extra)
    return torch.cat(parts, dim=axis).contiguous()


def real_row(t: torch.Tensor, layout: str, where: str, rows: Optional[int] = None
             ) -> torch.Tensor:
    """The real row of a two-row result."""
    axis = _row_dim(layout) if rows is None else rows
    return t.narrow(axis, 1 if where == "front" else 0, 1)

