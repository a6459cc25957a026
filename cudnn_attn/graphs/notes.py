"""What ``explain()`` says of how the cuDNN engine runs a call when that is not plain: the
graphs it builds differ from the call as written (more rows, a mask it did not ask for)."""

from __future__ import annotations

from ..model.problem import AttnProblem
from . import decode_rows
from ._spec import analyze

__all__ = ["plan_notes"]


def plan_notes(problem: AttnProblem) -> list[str]:
    """The notes of ``problem``'s plan (empty for a plain one); builds nothing."""
    if decode_rows.needed(problem) and not decode_rows.reasons(problem):
        where = "in front of" if decode_rows.side(problem) == "front" else "behind"
        return [f"S_q = 1 runs as a two-row graph (an extra query row {where} the real one, "
                f"dropped from the results): cuDNN's decode path is not bitwise repeatable "
                f"and this call must be (deterministic, or a FlashAttention surface)"]
    spec = analyze(problem)[0]
    if spec is not None and spec.synthetic_padding:
        return ["the graphs get a padding mask with the full lengths: without one, cuDNN's "
                "backward reads past the ends of the last tiles unmasked and gives NaN for rows "
                "whose LSE is below -88.7 (cudnn_attn.graphs.limits: key_tile)"]
    return []
