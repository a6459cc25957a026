"""cuDNN's ``score_mod``: a callable ``fn(graph, score) -> tensor`` that adds pointwise ops on the
attention score matrix, recorded once and then run anywhere.

``ScoreModGraph`` is a recording graph offering the pointwise ops of cuDNN's ``pygraph`` (``add``,
``sub``, ``mul``, ``div``, ``pow``, ``mod``, ``min``, ``max``, ``cmp_*``, ``logical_*``,
``binary_select``, ``gen_index``, ``floor``, ``ceil``, ``abs``, ``neg``, ``exp``, ``log``,
``tanh``, ``tanh_backward``, ``sigmoid``, ``sqrt``, ``rsqrt``, ``reciprocal``, ``identity``,
``sin``, ``cos``, ``tensor_scalar``) with cuDNN's keyword names. ``trace(score_mod, score_mod_bprop)`` turns the
callables into a ``ScoreMod``: a frozen, hashable program (part of a plan key) that

* ``evaluate``\\ s in torch (float64 or float32, whatever the scores are): the torch engine's
  meaning of the call;
* ``emit``\\ s the same ops onto a cuDNN graph (the engine's ``score_mod`` callback);
* serialises to JSON (``to_json``), which the CPU stand-in for cuDNN reads.

Semantics (cuDNN's): ``gen_index(x, axis)`` is the index along ``axis`` of the ``[B, H, S_q,
S_kv]`` score tensor; ``binary_select(input0, input1, mask)`` is ``mask ? input0 : input1``;
comparisons and logical ops give 0/1; a tensor whose data type is set to an integer type holds
values truncated toward zero. Constants are Python numbers, 1-element torch tensors or
``tensor_scalar(value, ...)``.

The backward: ``score_mod_bprop(graph, dP)`` (optional) maps the gradient of the modified scores
to the gradient of the raw ones and may use tensors its ``score_mod`` recorded (the same graph
records both); without it the chain rule of the forward program is used (exact for a mask, where
cuDNN needs none).

Equivalent PyTorch for a softcap ``lambda g, s: g.mul(a=g.tanh(input=g.div(a=s, b=c)), b=c)``::

    s = scale * q @ k.transpose(-1, -2)
    s = c * torch.tanh(s / c)            # the score_mod, before bias and masks
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["ScoreModGraph", "ScoreMod", "trace", "softcap", "SCORE", "DP", "INTEGER_TYPES"]

SCORE, DP = 0, 1  # node ids of the program's inputs
INTEGER_TYPES = frozenset({"INT32", "INT64", "INT8", "UINT8"})

# op name -> (input keyword names, torch function over float tensors)
_UNARY = {
    "floor": torch.floor, "ceil": torch.ceil, "abs": torch.abs, "neg": torch.neg,
    "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal,
    "identity": lambda x: x, "sin": torch.sin, "cos": torch.cos,
    "logical_not": lambda x: (x == 0).to(x.dtype),
}
_BINARY = {
    "add": (("a", "b"), torch.add), "sub": (("a", "b"), torch.sub),
    "mul": (("a", "b"), torch.mul), "div": (("a", "b"), torch.div),
    "pow": (("input0", "input1"), torch.pow), "mod": (("input0", "input1"), torch.fmod),
    "min": (("input0", "input1"), torch.minimum), "max": (("input0", "input1"), torch.maximum),
    "logical_and": (("a", "b"), lambda x, y: ((x != 0) & (y != 0)).to(x.dtype)),
    "logical_or": (("a", "b"), lambda x, y: ((x != 0) | (y != 0)).to(x.dtype)),
    # d tanh(input) scaled by loss: loss * (1 - tanh(input)^2)
    "tanh_backward": (("loss", "input"), lambda g, x: g * (1 - torch.tanh(x) ** 2)),
}
_COMPARE = {"cmp_eq": torch.eq, "cmp_neq": torch.ne, "cmp_gt": torch.gt, "cmp_ge": torch.ge,
            "cmp_lt": torch.lt, "cmp_le": torch.le}


class Node:
    """A tensor of the recording graph (what the callables receive and return)."""

    def __init__(self, graph: "ScoreModGraph", uid: int):
        self.graph, self.uid = graph, uid

    def set_data_type(self, data_type):
        self.graph.dtypes[self.uid] = _type_name(data_type)
        return self

    def get_data_type(self):
        return self.graph.dtypes.get(self.uid, "FLOAT")

    # cuDNN's virtual tensors accept these; shapes follow the score tensor here.
    def set_name(self, name):
        return self

    def set_dim(self, dim):
        return self

    def set_stride(self, stride):
        return self

    def set_is_virtual(self, value):
        return self


def _type_name(data_type) -> str:
    name = getattr(data_type, "name", data_type)
    if isinstance(data_type, torch.dtype):
        name = {torch.int32: "INT32", torch.int64: "INT64", torch.bool: "BOOLEAN",
                torch.float32: "FLOAT", torch.float64: "DOUBLE"}.get(data_type)
    if not isinstance(name, str):
        raise TypeError(f"set_data_type: expected a cudnn.data_type or torch.dtype, got "
                        f"{data_type!r}")
    return name.upper()


class ScoreModGraph:
    """The graph a ``score_mod`` / ``score_mod_bprop`` callable builds on (records its ops)."""

    def __init__(self):
        self.ops: list[tuple] = []       # (name, inputs, attrs); op i defines node i + 2
        self.dtypes: dict[int, str] = {}

    def _operand(self, value, op: str, arg: str):
        if isinstance(value, Node):
            if value.graph is not self:
                raise ValueError(f"{op}: {arg} belongs to another graph")
            return value.uid
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"{op}: {arg} must be a graph tensor or a 1-element constant, "
                                 f"got a tensor of shape {tuple(value.shape)}")
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{op}: {arg} must be a graph tensor or a number, got {value!r}")
        return ("const", float(value))

    def _record(self, op: str, inputs: tuple, attrs: tuple = (), compute_data_type=None):
        self.ops.append((op, inputs, attrs))
        node = Node(self, len(self.ops) + 1)
        if op in _COMPARE or op in ("logical_and", "logical_or", "logical_not"):
            self.dtypes[node.uid] = "BOOLEAN"
        return node

    def input(self, which: int) -> Node:
        """A handle on the program's input ``SCORE`` or ``DP`` in this graph (what program
        builders start from; the callables receive theirs as an argument)."""
        if which not in (SCORE, DP):
            raise ValueError(f"input: expected SCORE ({SCORE}) or DP ({DP}), got {which!r}")
        return self._record("identity", (which,))

    def tensor_scalar(self, value, scalar_type=None):
        """A constant (cuDNN: a rank-1 scalar tensor)."""
        return self._record("const", (self._operand(value, "tensor_scalar", "value"),))

    def tensor(self, *args, **kwargs):
        raise TypeError("a score_mod's constants are numbers, 1-element tensors or "
                        "graph.tensor_scalar(value, cudnn.scalar_type.COMPILE_TIME_CONST); "
                        "runtime graph tensors are not bound by this builder")

    def gen_index(self, input, axis, compute_data_type=None, name=""):
        if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis <= 3:
            raise ValueError(f"gen_index: axis must be 0..3 (B, H, S_q, S_kv), got {axis!r}")
        return self._record("gen_index", (self._operand(input, "gen_index", "input"),), (axis,))

    def binary_select(self, input0, input1, mask, compute_data_type=None, name=""):
        ins = tuple(self._operand(t, "binary_select", n)
                    for t, n in ((input0, "input0"), (input1, "input1"), (mask, "mask")))
        return self._record("binary_select", ins)

    def __getattr__(self, op):
        if op in _UNARY:
            def unary(input, compute_data_type=None, name=""):
                return self._record(op, (self._operand(input, op, "input"),))
            return unary
        if op in _BINARY:
            first, second = _BINARY[op][0]

            def binary(*args, compute_data_type=None, name="", **kwargs):
                values = dict(zip((first, second), args))
                values.update(kwargs)
                if set(values) != {first, second}:
                    raise TypeError(f"{op}() takes {first}= and {second}=, got {sorted(values)}")
                return self._record(op, (self._operand(values[first], op, first),
                                         self._operand(values[second], op, second)))
            return binary
        if op in _COMPARE:
            def compare(input, comparison, compute_data_type=None, name=""):
                return self._record(op, (self._operand(input, op, "input"),
                                         self._operand(comparison, op, "comparison")))
            return compare
        raise AttributeError(f"score_mod graphs offer cuDNN's pointwise ops; {op!r} is not one")


@dataclass(frozen=True)
class ScoreMod:
    """A recorded ``score_mod`` (and optional ``score_mod_bprop``) program; hashable."""

    ops: tuple
    dtypes: tuple            # ((node id, type name), ...)
    forward: int             # node id of the modified score
    bprop: Optional[int] = None
    label: str = "score_mod"

    @property
    def has_constants(self) -> bool:
        """Whether the program holds a numeric constant (cuDNN: a constant tensor, which has a
        backend-version floor of its own)."""
        return any(isinstance(a, tuple) for _, inputs, _ in self.ops for a in inputs)

    # -- evaluation in torch --------------------------------------------------------------------
    def _run(self, wanted: int, env: dict, index: Callable[[int], torch.Tensor], like):
        if wanted in env:
            return env[wanted]
        op, inputs, attrs = self.ops[wanted - 2]
        args = [(torch.tensor(a[1], dtype=like.dtype, device=like.device)
                 if isinstance(a, tuple) else self._run(a, env, index, like)) for a in inputs]
        if op in ("const", "identity"):
            out = args[0]
        elif op == "gen_index":
            out = index(attrs[0]).to(like.dtype)
        elif op == "binary_select":
            out = torch.where(args[2] != 0, args[0], args[1])
        elif op in _COMPARE:
            out = _COMPARE[op](args[0], args[1]).to(like.dtype)
        elif op in _UNARY:
            out = _UNARY[op](args[0])
        else:
            out = _BINARY[op][1](args[0], args[1])
        if dict(self.dtypes).get(wanted) in INTEGER_TYPES:
            out = torch.trunc(out)
        env[wanted] = out
        return out

    def apply(self, score: torch.Tensor, index: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The modified scores; ``index(axis)`` gives the B/H/S_q/S_kv index of each element
        (broadcastable to ``score``)."""
        return self._run(self.forward, {SCORE: score}, index, score)

    def gradient(self, score: torch.Tensor, grad: torch.Tensor,
                 index: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The gradient reaching the raw scores from ``grad`` (w.r.t. the modified ones)."""
        if self.bprop is not None:
            env = {SCORE: score, DP: grad}
            return self._run(self.bprop, env, index, score)
        raw = score.detach().requires_grad_()
        with torch.enable_grad():
            out = self._run(self.forward, {SCORE: raw}, index, raw)
        if not out.requires_grad:  # the program ignores the score
            return torch.zeros_like(grad)
        (d,) = torch.autograd.grad(out, raw, grad)
        return torch.nan_to_num(d, nan=0.0)

    # -- cuDNN ------------------------------------------------------------------------------------
    def callbacks(self):
        """``(score_mod, score_mod_bprop or None)`` for a cuDNN graph: they replay the program's
        ops with cuDNN's pointwise ops; the bprop reads what the forward recorded (same graph)."""
        env: dict = {}
        types = dict(self.dtypes)

        def run(g, wanted):
            import cudnn  # only reached while building a cuDNN graph

            if wanted in env:
                return env[wanted]
            op, inputs, attrs = self.ops[wanted - 2]
            args = [g.tensor_scalar(a[1], cudnn.scalar_type.COMPILE_TIME_CONST)
                    if isinstance(a, tuple) else run(g, a) for a in inputs]
            if op in ("const", "identity"):
                out = args[0]
            elif op == "gen_index":
                out = g.gen_index(input=args[0], axis=attrs[0])
            elif op == "binary_select":
                out = g.binary_select(input0=args[0], input1=args[1], mask=args[2])
            elif op in _COMPARE:
                out = getattr(g, op)(input=args[0], comparison=args[1])
            elif op in _UNARY:
                out = getattr(g, op)(input=args[0])
            else:
                first, second = _BINARY[op][0]
                out = getattr(g, op)(**{first: args[0], second: args[1]})
            if wanted in types and op not in ("const", "identity"):
                out.set_data_type(getattr(cudnn.data_type, types[wanted]))
            env[wanted] = out
            return out

        def forward(g, score):
            env.clear()
            env[SCORE] = score
            return run(g, self.forward)

        def backward(g, dp):
            env[DP] = dp
            return run(g, self.bprop)

        return forward, (None if self.bprop is None else backward)

    # -- serialised form -----------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"ops": [[op, [list(a) if isinstance(a, tuple) else a for a in ins],
                                    list(attrs)] for op, ins, attrs in self.ops],
                           "dtypes": dict(self.dtypes), "forward": self.forward,
                           "bprop": self.bprop, "label": self.label}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "ScoreMod":
        raw = json.loads(text)
        ops = tuple((op, tuple(tuple(a) if isinstance(a, list) else a for a in ins),
                     tuple(attrs)) for op, ins, attrs in raw["ops"])
        return ScoreMod(ops, tuple(sorted((int(k), v) for k, v in raw["dtypes"].items())),
                        raw["forward"], raw["bprop"], raw["label"])


def trace(score_mod, score_mod_bprop=None, label: str = "score_mod") -> ScoreMod:
    """Record ``score_mod(graph, score)`` (and ``score_mod_bprop(graph, dP)``) as a program."""
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable (graph, score) -> tensor, got "
                        f"{score_mod!r}")
    if score_mod_bprop is not None and not callable(score_mod_bprop):
        raise TypeError(f"score_mod_bprop must be callable (graph, dP) -> tensor, got "
                        f"{score_mod_bprop!r}")
    g = ScoreModGraph()
    out = score_mod(g, Node(g, SCORE))
    if not isinstance(out, Node) or out.graph is not g:
        raise TypeError(f"score_mod must return a tensor of the graph it was given, got {out!r}")
    back = None
    if score_mod_bprop is not None:
        back = score_mod_bprop(g, Node(g, DP))
        if not isinstance(back, Node) or back.graph is not g:
            raise TypeError(f"score_mod_bprop must return a tensor of its graph, got {back!r}")
        back = back.uid
    return ScoreMod(tuple(g.ops), tuple(sorted(g.dtypes.items())), out.uid, back, label)


def softcap(cap: float) -> ScoreMod:
    """cuDNN's softcap score modifier (``attn::score_modifiers::Softcap``): forward
    ``cap * tanh(s / cap)``, backward ``tanh_backward(dP * cap, s / cap) / cap`` reading the
    forward's ``s / cap`` (Gemma-2, Grok-1)."""
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not math.isfinite(cap) \
            or cap <= 0:
        raise ValueError(f"softcap must be a finite number > 0, got {cap!r}")
    saved = {}

    def forward(g, s):
        saved["before_tanh"] = g.div(a=s, b=cap)
        return g.mul(a=g.tanh(input=saved["before_tanh"]), b=cap)

    def backward(g, dp):
        grad = g.tanh_backward(loss=g.mul(a=dp, b=cap), input=saved["before_tanh"])
        return g.div(a=grad, b=cap)

    return trace(forward, backward, label=f"softcap({cap:g})")
