"""What ``explain()`` says of how the cuDNN engine runs a call when that is not plain: the
graphs it builds differ from the call as written (more rows, a mask it did not ask for)."""

from __future__ import annotations

from ..model.problem import AttnProblem
from . import churn, decode_rows, length_buckets
from ._spec import analyze
from .head_pad import needs_padding, padded_problem

__all__ = ["plan_notes"]


def plan_notes(problem: AttnProblem) -> list[str]:
    """The notes of ``problem``'s plan (empty for a plain one); builds nothing."""
    graphed = padded_problem(problem) if needs_padding(problem) else problem
    spec = analyze(graphed)[0]
    if spec is not None and churn.buckets(graphed, spec):
        bucketed = length_buckets.bucketed_problem(graphed, planning=True)
        return ([f"runs on the graph of its length bucket (S_q {graphed.seq_q} -> "
                f"{bucketed.seq_q}, S_kv {graphed.seq_kv} -> {bucketed.seq_kv}; the real "
                f"lengths as its padding mask, q, k, v padded and the results sliced): "
                f"{churn.shapes_built(spec.forward_for(graphed))} graphs of this kind were "
                f"built at call time and this shape's are not cached (its own after "
                f"{length_buckets.PROMOTE_AFTER} forwards; cudnn_attn.graphs.length_buckets)"]
                + plan_notes(bucketed))
    if spec is None:
        return _graph_notes(problem)
    kept = churn.kept_exact(graphed, spec)
    churning = [f"{churn.shapes_built(spec.forward_for(graphed))} graphs of this kind were "
                f"built at call time, but this shape builds its own rather than run on a length "
                f"bucket's: " + "; ".join(kept)] if kept else []
    return _graph_notes(problem) + churning


def _graph_notes(problem: AttnProblem) -> list[str]:
    """The notes of a call that runs on its own graphs."""
    if decode_rows.needed(problem) and not decode_rows.reasons(problem):
        where = "in front of" if decode_rows.side(problem) == "front" else "behind"
        return [f"S_q = 1 runs as a two-row graph (an extra query row {where} the real one, "
                f"dropped from the results): {decode_rows.cause(problem)}"]
    if problem.seq_q == 1 and problem.repeatable and decode_rows.keys_end_inside(problem):
        return ["S_q = 1 with keys that end at a padding mask's lengths runs cuDNN's one-row "
                "decode graph, not bitwise repeatable there (issue 36): a two-row graph reads "
                "V rows past the lengths (0 * NaN gave NaN on an H200; graphs.decode_rows)"]
    spec = analyze(problem)[0]
    if spec is not None and spec.synthetic_padding:
        return ["the graphs get a padding mask with the full lengths: without one, cuDNN's "
                "backward reads past the ends of the last tiles unmasked and gives NaN for rows "
                "whose LSE is below -88.7 (cudnn_attn.graphs.limits: key_tile)"]
    return []
