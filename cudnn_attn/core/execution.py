"""The one way from a planned call to an engine: every surface runs its plans through here.

A surface translates its arguments into an ``AttnProblem`` and ``Inputs``; this module plans it
(``plan_call``: the dropout engine pinned from forward to backward), runs the plan's forward and
backward (``forward``, ``backward``, or ``run`` when autograd should record the call), and hides
what is not a token (positions past ``Padding`` lengths) before any engine sees it. Nothing else
in the package calls ``plan.forward`` / ``plan.backward`` (``tests/test_architecture.py``).

The lse convention stays the engines' (``[B, H_q, S_q]``, natural log, ``-inf`` on a row that sees
no key); ``lse_from_flash`` converts FlashAttention's ``+inf`` rows at its edge.

Equivalent PyTorch of ``forward(problem, plan, Inputs(q, k, v))`` (bhsd, no mask)::

    s = problem.scale * q @ k.transpose(-1, -2)
    out, lse = torch.softmax(s, -1) @ v, s.logsumexp(-1)
"""

from __future__ import annotations

import dataclasses
from typing import Optional
import math
import torch

from . import dispatch
from .autograd_node import apply_entry
from ..errors import NotSupportedError
from ..model.problem import AttnProblem
from ..model.inputs import Inputs, hide_padded_rows, hide_padding, hides_keys
from ..model.storage import Ragged

__all__ = ["plan_call", "plan_on", "plan_stored", "dropout_engine", "forward", "backward", "run", "direct_runner",
           "lse_from_flash"]


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------

def plan_call(problem: AttnProblem, backend: str = "auto"):
    """``(engine, problem, plan)`` of a call.

    A dropout mask can only be replayed by the engine that drew it, so a dropout problem picks
    its engine as for its backward (``requires_grad``, deterministic off) in both directions: a
    forward is planned as that backward's forward, and a backward that engine cannot run raises
    ``NotSupportedError`` instead of silently moving to an engine with another mask.
    """
    if problem.dropout_p == 0:
        engine, plan = dispatch.plan_for(problem, backend)
        return engine, problem, plan
    probe = dataclasses.replace(problem, requires_grad=True, deterministic=False)
    engine = dropout_engine(probe, backend)
    if not problem.requires_grad:
        return engine, probe, engine.plan(probe)
    return plan_on(engine, problem, f"the dropout mask was made by {engine.name!r}, so its "
                                    "backward must run there")


def plan_on(engine, problem: AttnProblem, why: str):
    """``(engine, problem, plan)`` on the engine a call is pinned to (the one that replays its
    dropout mask); ``NotSupportedError`` saying ``why`` when that engine cannot run it."""
    reasons = engine.supports(problem)
    if reasons:
        raise NotSupportedError(problem, {engine.name: [why, *reasons]}, forced=engine.name)
    return engine, problem, engine.plan(problem)


def plan_stored(problem: AttnProblem, backend: str = "auto", *, required: bool = False):
    """``plan_call`` of a packed/paged call (``packed.calls``) on an engine that runs its storage
    as it lies (``runs_stored``), or ``None`` when none does and the surface should build dense
    batches instead (every surface's one fallback: ``varlen``). A forced backend, or
    ``required`` (a dropout stream only that engine replays), raises instead."""
    packed_dropout = problem.dropout_p > 0 and isinstance(problem.storage, Ragged)
    if not packed_dropout and not any(
            engine.runs_stored and (backend == engine.name or backend == "auto" and not (
                dispatch.reasons_of(engine, problem) or dispatch.auto_reasons(engine, problem)))
            for engine in dispatch.BACKENDS):
        # Plan nothing: another engine's plan of the storage is a padded batch of the
        # problem's bounds, whose cost follows those (a generous max_seqlen of 10**6 asked for
        # seconds and gigabytes), and it would be dropped below.
        return None
    try:
        engine, problem, plan = plan_call(problem, backend)
    except NotSupportedError:
        if required or backend != "auto":
            raise
        return None
    if not engine.runs_stored and not packed_dropout:
        # It would read a dense cache whole: the dense-batch path gives it only the prefix in
        # use. A packed call with dropout stays (the torch engine's padded batch): its forward
        # and backward then draw the mask over the same batch, whichever runs first.
        return None
    return engine, problem, plan


def dropout_engine(probe: AttnProblem, backend: str = "auto"):
    """The engine that draws and replays the dropout mask of ``probe`` (a problem planned as
    for its backward)."""
    return dispatch.plan_for(probe, backend)[0]


def direct_runner(problem: AttnProblem, plan):
    """``(q, k, v) -> out`` when the plan runs this call through one runner bound to its
    signature (a call that needs no lse; one that requires grad records its own autograd node),
    else ``None``: every plan answers ``direct(problem)``. A runner of a call with a bias tensor
    takes it too, ``(q, k, v, bias) -> out``, and one with dropout the call's generator,
    ``(q, k, v, bias or None, generator) -> out`` (``api._run_direct``)."""
    if problem.return_lse:
        return None
    return plan.direct(problem)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def forward(problem: AttnProblem, plan, inputs: Inputs, need_lse: bool = True,
            row_stats: Optional[dict] = None, weights: Optional[dict] = None):
    """``(out, lse)`` of one call, outside autograd; positions past ``Padding`` lengths never
    reach the engine (``model.inputs.hide_padding``). ``row_stats`` (a dict, torch engine only)
    receives each row's score maximum and sum of exponentials (the builder's logit_max and
    score_sum_exp); ``weights`` (a dict, torch engine only) the attention weights before and
    after dropout (``"probs"``, ``"dropped"``, ``[B, H_q, S_q, S_kv]``). No gradient follows,
    so the padded query rows are kept unless those extras (which have rows there) are asked."""
    inputs = hide_padding(problem, inputs, queries=row_stats is not None or weights is not None,
                          keys=hides_keys(plan, False))
    extra = {} if row_stats is None else {"row_stats": row_stats}
    if weights is not None:
        extra["weights"] = weights
    with torch.no_grad():
        return plan.forward(problem, inputs, need_lse=need_lse, **extra)


def backward(problem: AttnProblem, plan, inputs: Inputs, out, lse, dout, dlse=None):
    """``(dq, dk, dv, dbias)`` of one call from its forward's ``out`` and ``lse`` (engines'
    convention), outside autograd. Whatever the rows past the ``Padding`` lengths hold (in the
    inputs, ``out`` or ``dout``) never reaches a gradient."""
    inputs = hide_padding(problem, inputs)
    out, dout = hide_padded_rows(problem, out), hide_padded_rows(problem, dout)
    with torch.no_grad():
        return plan.backward(problem, inputs, out, lse, dout, dlse)


class _Recorded(torch.autograd.Function):
    """One call as an autograd node: the backward replays the forward's dropout state."""

    @staticmethod
    def forward(ctx, call, q, k, v, bias):
        # call = (problem, plan, dropout, dropout_mask): one argument, not four (apply walks
        # every argument on each call)
        problem, plan, dropout, dropout_mask = call
        out, lse = plan.forward(problem, Inputs(q, k, v, bias, dropout, dropout_mask))
        ctx.problem, ctx.plan, ctx.dropout, ctx.dropout_mask = problem, plan, dropout, dropout_mask
        ctx.save_for_backward(q, k, v, bias, out, lse)
        # An unused lse then arrives as None, not zeros: engines skip its term (and the torch
        # engine can use the fused kernels' own backward, which has none).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        inputs = Inputs(q, k, v, bias, ctx.dropout, ctx.dropout_mask)
        dq, dk, dv, dbias = ctx.plan.backward(ctx.problem, inputs, out, lse, dout, dlse)
        return None, dq, dk, dv, dbias


_RECORD_DIRECT = apply_entry(_Recorded)  # run skips it under a functorch transform
_functorch_active = torch._C._are_functorch_transforms_active


def run(problem: AttnProblem, plan, inputs: Inputs, need_lse: bool):
    """``(out, lse)`` of one call, differentiable when the problem needs it (the dropout state
    and the plan kept for the backward). Positions past ``Padding`` lengths never reach the
    engine, and the gradient reaching them stops at the output."""
    padded = problem.mask is not None and problem.padding is not None
    grad = problem.requires_grad and torch.is_grad_enabled()
    if padded:
        inputs = hide_padding(problem, inputs, queries=grad, keys=hides_keys(plan, grad))
    if grad:
        record = _Recorded.apply if _RECORD_DIRECT is None or _functorch_active() \
            else _RECORD_DIRECT
        out, lse = record((problem, plan, inputs.dropout, inputs.dropout_mask),
                          inputs.q, inputs.k, inputs.v, inputs.bias)
        return (hide_padded_rows(problem, out) if padded else out), lse
    return plan.forward(problem, inputs, need_lse=need_lse)


# ---------------------------------------------------------------------------------------------
# The lse convention at FlashAttention's edge
# ---------------------------------------------------------------------------------------------

def lse_from_flash(lse: torch.Tensor) -> torch.Tensor:
    """A FlashAttention ``softmax_lse`` in the engines' convention: a row that sees no key is
    ``+inf`` in FlashAttention's, ``-inf`` in the engines'. One kernel (a comparison and a
    fill cost two); finite and NaN entries kept."""
    return torch.nan_to_num(lse, nan=math.nan, posinf=-math.inf, neginf=-math.inf)

