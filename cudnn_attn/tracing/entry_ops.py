"""Entry points whose eager work is data-dependent, as custom ops (varlen, KV cache).

``attention_varlen`` and ``attention_with_kvcache`` read their lengths on the host and size padded
buffers by them; the compiler cannot trace that, but their outputs have static shapes. So under
torch.compile / torch.export they run as one op::

    cudnn_attn::entry_forward(Tensor? t0, ..., Tensor? t6, str name, str spec, str ints)
        -> Tensor[]
    cudnn_attn::entry_backward(Tensor?[] grads, Tensor?[] tensors, bool[] needs, str name,
                               str spec, str ints) -> Tensor[]

(The forward takes its tensors one by one, as autograd does not look for inputs inside a list,
and its integers as text ``"8,8"``, as the generated autograd wrapper expects no list of
non-tensors.)

``name`` picks a function registered here by its module (``register``), ``spec`` is the call's
constants (``call_spec`` text) and ``ints`` its integer arguments (e.g. maximum lengths). The forward runs the eager function; the backward runs it again under autograd and
differentiates it (the cost of one more forward, only on the compiled path). A dropout call gets
its seed as a tensor, so both runs draw the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from .call_spec import decode

__all__ = ["call", "entry_backward", "entry_forward", "register"]

# name -> (run(tensors, call, ints) -> outputs, shapes(tensors, call, ints) -> ((shape, dtype), ...));
# each module registers its own at import, so this module imports none of them.
_ENTRIES: dict[str, tuple[Callable, Callable]] = {}


def register(name: str, run: Callable, shapes: Callable) -> None:
    """Make ``run`` callable as ``entry_forward(tensors, name, spec, ints)``; ``shapes`` gives the
    outputs' ``(shape, dtype)`` from the (fake) tensors, the decoded spec and the ints."""
    _ENTRIES[name] = (run, shapes)


def _entry(name: str):
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"no cudnn_attn entry op named {name!r}") from None


SLOTS = 7  # tensor arguments of entry_forward; unused ones are None


@torch.library.custom_op("cudnn_attn::entry_forward", mutates_args=())
def entry_forward(t0: Optional[Tensor], t1: Optional[Tensor], t2: Optional[Tensor],
                  t3: Optional[Tensor], t4: Optional[Tensor], t5: Optional[Tensor],
                  t6: Optional[Tensor], name: str, spec: str, ints: str) -> list[Tensor]:
    run, _ = _entry(name)
    with torch.no_grad():
        return [out.clone(memory_format=torch.contiguous_format)
                for out in run([t0, t1, t2, t3, t4, t5, t6], decode(spec), _ints(ints))]


@entry_forward.register_fake
def _entry_forward_fake(t0, t1, t2, t3, t4, t5, t6, name, spec, ints):
    _, shapes = _entry(name)
    tensors = [t0, t1, t2, t3, t4, t5, t6]
    ref = next(t for t in tensors if t is not None)
    return [ref.new_empty(shape, dtype=dtype)
            for shape, dtype in shapes(tensors, decode(spec), _ints(ints))]


@torch.library.custom_op("cudnn_attn::entry_backward", mutates_args=())
def entry_backward(grads: list[Optional[Tensor]], tensors: list[Optional[Tensor]],
                   needs: list[bool], name: str, spec: str, ints: str) -> list[Tensor]:
    run, _ = _entry(name)
    with _autograd_inside_op(), torch.enable_grad():
        inputs = [t.detach().requires_grad_(True) if need else t
                  for t, need in zip(tensors, needs)]
        outputs = run(inputs, decode(spec), _ints(ints))
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wrt = [t for t, need in zip(inputs, needs) if need]
        found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                    allow_unused=True) if pairs and wrt else [None] * len(wrt)
    found = iter(found)
    result = []
    for t, need in zip(tensors, needs):
        grad = next(found) if need else None
        result.append(torch.zeros_like(t) if need and grad is None else
                      grad.contiguous() if need else torch.empty(0))
    return result


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd back on inside an op's implementation (the dispatcher excludes its keys there),
    so the backward can differentiate its recomputed forward."""
    keys = [torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
            torch._C.DispatchKey.ADInplaceOrView]
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, excluded in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


@entry_backward.register_fake
def _entry_backward_fake(grads, tensors, needs, name, spec, ints):
    return [t.new_empty(t.shape) if need else torch.empty(0, device=t.device if t is not None
                                                         else "cpu")
            for t, need in zip(tensors, needs)]


def _setup_context(ctx, inputs, output):
    *tensors, name, spec, ints = inputs
    ctx.save_for_backward(*[t for t in tensors if t is not None])
    ctx.present = [t is not None for t in tensors]
    ctx.needs = [t is not None and t.requires_grad and t.is_floating_point() for t in tensors]
    ctx.name, ctx.spec, ctx.ints = name, spec, ints


def _backward(ctx, grads):
    saved = iter(ctx.saved_tensors)
    tensors = [next(saved) if present else None for present in ctx.present]
    result = entry_backward(list(grads), tensors, ctx.needs, ctx.name, ctx.spec, ctx.ints)
    return (*(g if need else None for g, need in zip(result, ctx.needs)), None, None, None)


entry_forward.register_autograd(_backward, setup_context=_setup_context)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def call(name: str, tensors: list, spec: str, ints: list) -> list:
    """Run the registered entry ``name`` through the op (the traced path of its caller)."""
    tensors = list(tensors) + [None] * (SLOTS - len(tensors))
    return entry_forward(*tensors, name, spec, ",".join(str(int(x)) for x in ints))
