"""A call as an autograd node at the least host cost: ``Function.apply``'s C entry point, and the
node of a direct runner (``graphs.launch.DirectCall``) whose two halves are bound once per call
signature.

Why a module of its own: engines' runners record their node here, and ``core.execution`` (which
imports the engines through ``dispatch``) does too; neither may import the other at load time.
"""

from __future__ import annotations

import torch

__all__ = ["apply_entry", "record_direct"]


def apply_entry(function):
    """``function.apply`` without the Python layer of ``torch.autograd.Function.apply`` (about
    4 us of a tiny call's host time on the CPU): that layer only binds default arguments for a
    ``setup_context`` (the nodes here have none) and unwraps functorch's dead wrappers, so the
    caller skips it when no functorch transform is active. ``None`` when this torch lacks the C
    entry point."""
    base = getattr(torch._C, "_FunctionBase", None)
    entry = getattr(base, "__dict__", {}).get("apply")
    return entry.__get__(None, function) if entry is not None else None


class _DirectNode(torch.autograd.Function):
    """``out`` of ``call.record(q, k, v, extra) -> (out, saved)``; the backward is
    ``call.gradients(q, k, v, extra, out, saved, dout) -> (dq, dk, dv)``. ``extra``: ``None``,
    or what the call binds besides q, k, v (``graphs.launch.PerCall``: its bias, dropout stream,
    lengths and empty rows), kept on the node as it is: one argument, so that the plainest
    call's node costs what it did."""

    @staticmethod
    def forward(ctx, call, q, k, v, extra):
        out, saved = call.record(q, k, v, extra)
        ctx.call, ctx.extra = call, extra
        ctx.save_for_backward(q, k, v, out, saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, saved = ctx.saved_tensors
        return (None, *ctx.call.gradients(q, k, v, ctx.extra, out, saved, dout), None)


_DIRECT_ENTRY = apply_entry(_DirectNode)


def record_direct(call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  extra=None) -> torch.Tensor:
    """``out`` of ``call`` (a ``DirectCall``) recorded as an autograd node. Only eager calls with
    plain tensors come here (``api._through_ops`` sends traced, functorch and autocast calls to
    the custom ops), so the C entry point serves."""
    return (_DIRECT_ENTRY or _DirectNode.apply)(call, q, k, v, extra)
