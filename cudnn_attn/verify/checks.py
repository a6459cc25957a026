"""Run one selftest case on one engine in one dtype and judge it against the oracle.

The verdict per direction is ``"pass"``, ``"FAIL"``, ``"declined"`` (the engine said it cannot run
this, with reasons) or ``"n/a"`` (no backward on that surface). An engine passes when its error
against the float64 oracle is at most 2x (forward) / 3x (backward) that of the naive computation in
the inputs' dtype, its output and LSE are finite where they must be, ``-inf`` LSE exactly on the
rows that see nothing, and it repeats bitwise where it promises to.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field

import torch

# The public functions by their modules: the package root imports this package (for type
# checkers), so nothing here imports the root.
from cudnn_attn.api import attention
from cudnn_attn.errors import NotSupportedError
from cudnn_attn.model.masks import Alibi, Causal, Neighborhood, Padding, RelPosBias, SlidingWindow
from cudnn_attn.varlen import attention_varlen, attention_with_kvcache

from . import oracle
from .cases import Case

__all__ = ["Outcome", "run_case", "FORWARD_LIMIT", "BACKWARD_LIMIT", "BITWISE_BACKWARD"]

FORWARD_LIMIT = 2.0
BACKWARD_LIMIT = 3.0
# Below these the naive computation is exact by luck on tiny problems; an engine gets this much.
_ERROR_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-4,
                torch.bfloat16: 1e-3}
# Engines whose backward is deterministic by construction (every engine's forward is).
BITWISE_BACKWARD = frozenset({"torch"})


@dataclass
class Outcome:
    """The verdict of one (case, backend, dtype)."""

    case: Case
    backend: str
    dtype: str
    forward: str = "pass"
    backward: str = "n/a"
    forward_ratio: float | None = None
    backward_ratio: float | None = None
    detail: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if "FAIL" in (self.forward, self.backward):
            return "FAIL"
        return "declined" if self.forward == "declined" else "pass"

    def fail(self, direction: str, message: str) -> None:
        setattr(self, direction, "FAIL")
        self.detail.append(f"{direction}: {message}")

    def as_dict(self) -> dict:
        return {"case": self.case.name, "feature": self.case.feature, "backend": self.backend,
                "dtype": self.dtype, "status": self.status, "forward": self.forward,
                "backward": self.backward, "forward_ratio": self.forward_ratio,
                "backward_ratio": self.backward_ratio, "detail": self.detail,
                "seconds": round(self.seconds, 4), "params": self.case.as_dict()}


# ---------------------------------------------------------------------------------------------
# Inputs and calls
# ---------------------------------------------------------------------------------------------

def _inputs(case: Case, dtype, device):
    """q, k, v (bhsd) and the bias operand, the same numbers for every engine and dtype."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)

    q = randn(case.batch, case.heads_q, case.seq_q, case.dim_qk)
    k = randn(case.batch, case.heads_kv, case.seq_kv, case.dim_qk)
    v = randn(case.batch, case.heads_kv, case.seq_kv, case.dim_v)
    bias = None
    if case.bias == "tensor":
        bias = randn(case.batch, case.heads_q, case.seq_q, case.seq_kv)
    elif case.bias == "rpb":
        kernel = case.masks_of("neighborhood")[0][2]
        bias = randn(case.heads_q, *(2 * k - 1 for k in kernel))
    dout = randn(case.batch, case.heads_q, case.seq_q, case.dim_v)
    return q, k, v, bias, dout


def _library_mask(case: Case):
    parts = []
    for kind, *params in case.mask:
        if kind == "causal":
            parts.append(Causal(params[0]))
        elif kind == "window":
            parts.append(SlidingWindow(*params))
        elif kind == "padding" and case.surface == "attention":
            parts.append(Padding(*params))
        elif kind == "neighborhood":
            parts.append(Neighborhood(*params))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return mask


def _library_bias(case: Case, bias):
    if case.bias == "alibi":
        return Alibi()
    if case.bias == "rpb":
        return RelPosBias(bias)
    return bias


def _pack(x, lens):
    """bhsd -> ``[total, H, D]`` of the first ``lens[b]`` positions of each sequence."""
    return torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])


def _unpack(packed, lens, seq, fill=0.0):
    """``[total, H, D]`` (or ``[H, total]`` when ``packed`` is 2-D) -> bhsd / ``[B, H, S]``."""
    rows, start = [], 0
    for n in lens:
        chunk = packed[start:start + n] if packed.dim() == 3 else packed[:, start:start + n].T
        start += n
        pad = chunk.new_full((seq - n, *chunk.shape[1:]), fill)
        rows.append(torch.cat([chunk, pad]))
    return torch.stack(rows).transpose(1, 2)  # [B, S, H(, D)] -> [B, H, S(, D)]


def _cumulative(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _paged_cache(case: Case, x, lens_kv):
    """``x`` bhsd keys -> a paged ``[blocks, page, H, D]`` cache in shuffled pages, its table."""
    page = case.page_size
    per_seq = math.ceil(case.seq_kv / page)
    blocks = case.batch * per_seq
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(7))
    table = order.view(case.batch, per_seq).to(torch.int32)
    cache = x.new_zeros(blocks, page, x.shape[1], x.shape[3])
    padded = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, per_seq * page - x.shape[2]))
    cache[order] = padded.reshape(blocks, page, x.shape[1], x.shape[3])
    return cache, table.to(x.device)


def call(case: Case, backend: str, q, k, v, bias, generator=None):
    """The engine's ``(out, lse)`` as bhsd / ``[B, H, S_q]``, through the case's surface."""
    mask, lib_bias = _library_mask(case), _library_bias(case, bias)
    common = dict(scale=case.dim_qk ** -0.5, softcap=case.softcap, return_lse=True,
                  backend=backend)
    if case.surface == "attention":
        return attention(q, k, v, mask=mask, bias=lib_bias, dropout_p=case.dropout_p,
                                    generator=generator, **common)
    lens_q, lens_kv = case.lengths
    if case.surface == "varlen":
        out, lse = attention_varlen(
            _pack(q, lens_q), _pack(k, lens_kv), _pack(v, lens_kv),
            _cumulative(lens_q, q.device), _cumulative(lens_kv, q.device), case.seq_q,
            case.seq_kv, mask=mask, bias=lib_bias, **common)
        return _unpack(out, lens_q, case.seq_q), _unpack(lse, lens_q, case.seq_q, -math.inf)
    if case.surface == "paged":
        k_cache, table = _paged_cache(case, k, lens_kv)
        v_cache, _ = _paged_cache(case, v, lens_kv)
        out, lse = attention_with_kvcache(
            q.transpose(1, 2), k_cache, v_cache,
            torch.tensor(lens_kv, dtype=torch.int32, device=q.device), block_table=table,
            mask=mask, bias=lib_bias, **common)
        return out.transpose(1, 2), lse
    raise ValueError(f"unknown surface {case.surface!r}")


# ---------------------------------------------------------------------------------------------
# Judging
# ---------------------------------------------------------------------------------------------

def _error(x, ref) -> float:
    x, ref = x.double(), ref.double()
    both_inf = torch.isneginf(x) & torch.isneginf(ref)
    return float((x - ref).abs().masked_fill(both_inf, 0).max()) if x.numel() else 0.0


def _ratio(err: float, base: float, dtype) -> float:
    return err / max(base, _ERROR_FLOOR[dtype])


def poison_allocator(device: torch.device) -> None:
    """Leave NaN in the CUDA caching allocator's free blocks, so an engine that forgets to write
    an output element returns NaN instead of a plausible zero (a no-op on the CPU)."""
    if device.type != "cuda":
        return
    blocks = [torch.full((n,), float("nan"), device=device) for n in (2**10, 2**14, 2**18)
              for _ in range(8)]
    blocks += [torch.full((2**22,), float("nan"), device=device) for _ in range(4)]
    del blocks


def _check_forward(outcome: Outcome, case, out, lse, ref, base, dtype) -> None:
    ref_out, ref_lse = ref
    if not torch.isfinite(out).all():
        return outcome.fail("forward", "non-finite output")
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
        return outcome.fail("forward", "lse is -inf on other rows than the rows that see nothing")
    ratios = [_ratio(_error(out, ref_out), _error(base[0], ref_out), dtype),
              _ratio(_error(lse, ref_lse), _error(base[1], ref_lse), dtype)]
    outcome.forward_ratio = max(ratios)
    if outcome.forward_ratio > FORWARD_LIMIT:
        outcome.fail("forward", f"error {outcome.forward_ratio:.2f}x the naive {dtype}'s "
                                f"(out {ratios[0]:.2f}x, lse {ratios[1]:.2f}x)")


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout, allow_unused=True)


def _check_backward(outcome: Outcome, engine, ref, base, dtype, names) -> None:
    ratios = {}
    for name, g, r, b in zip(names, engine, ref, base):
        if r is None:
            continue
        if g is None or not torch.isfinite(g).all():
            return outcome.fail("backward", f"d{name} missing or non-finite")
        ratios[name] = _ratio(_error(g, r), _error(b, r), dtype)
    outcome.backward = "pass"
    outcome.backward_ratio = max(ratios.values())
    if outcome.backward_ratio > BACKWARD_LIMIT:
        worst = ", ".join(f"d{n} {x:.2f}x" for n, x in ratios.items())
        outcome.fail("backward", f"error {outcome.backward_ratio:.2f}x the naive {dtype}'s "
                                 f"({worst})")


def _reasons(exc: NotSupportedError) -> str:
    """The engine's own reasons, one line (the exception's text also repeats the problem)."""
    reasons = [r for verdict in exc.reasons.values() for r in
               ([verdict] if isinstance(verdict, str) else verdict)]
    return "; ".join(reasons) or str(exc)


def _leaves(case, q, k, v, bias, dtype):
    tensors = [q, k, v] + ([bias] if case.bias in ("tensor", "rpb") else [])
    return [t.detach().to(dtype).requires_grad_(case.backward) for t in tensors]


def _judge(outcome: Outcome, case: Case, backend: str, dtype, device) -> None:
    q, k, v, bias, dout = _inputs(case, dtype, device)
    names = ("q", "k", "v", "bias")
    scale = case.dim_qk ** -0.5
    poison_allocator(device)
    leaves = _leaves(case, q, k, v, bias, dtype)
    try:
        out, lse = call(case, backend, *leaves[:3], leaves[3] if len(leaves) > 3 else None)
    except NotSupportedError as exc:
        outcome.forward = "declined"
        outcome.detail.append(_reasons(exc))
        return
    exact = _leaves(case, q, k, v, bias, torch.float64)
    naive = _leaves(case, q, k, v, bias, dtype)
    ref = oracle.reference(case, *exact[:3], *exact[3:], scale=scale)
    base = oracle.reference(case, *naive[:3], *naive[3:], scale=scale, dtype=dtype)
    _check_forward(outcome, case, out.detach(), lse.detach(), [r.detach() for r in ref],
                   [b.detach() for b in base], dtype)
    again = call(case, backend, *leaves[:3], leaves[3] if len(leaves) > 3 else None)
    if not (torch.equal(again[0], out) and torch.equal(again[1], lse)):
        outcome.fail("forward", "two identical calls differ (not bitwise repeatable)")
    if not case.backward:
        return
    try:
        grads = _grads(out, leaves, dout)
    except NotSupportedError as exc:
        outcome.backward = "declined"
        outcome.detail.append(f"backward: {_reasons(exc)}")
        return
    _check_backward(outcome, grads, _grads(ref[0], exact, dout.double()),
                    _grads(base[0], naive, dout), dtype, names)
    if backend in BITWISE_BACKWARD:
        repeat = _grads(again[0], leaves, dout)
        if not all(a is None or torch.equal(a, b) for a, b in zip(grads, repeat)):
            outcome.fail("backward", "two identical backward calls differ")


def _judge_dropout(outcome: Outcome, case: Case, backend: str, dtype, device) -> None:
    """Dropout cannot match an oracle draw for draw; check what it must satisfy instead.

    With ``q = 0`` every visible key gets weight ``1/n``; with ``v`` the identity the output *is*
    the dropped, rescaled weight matrix, so each entry must be ``0`` or ``1/((1-p) n)``, the kept
    fraction must be ``1 - p`` within 5 standard deviations, the same generator seed must replay
    bitwise, and the backward must use the forward's mask: ``dv = out^T @ dout``.
    """
    p, n = case.dropout_p, case.seq_kv
    shape = (case.batch, case.heads_kv, n, n)
    q = torch.zeros(case.batch, case.heads_q, case.seq_q, case.dim_qk, device=device, dtype=dtype)
    k = torch.randn(case.batch, case.heads_kv, n, case.dim_qk, device=device, dtype=dtype)
    v = torch.eye(n, device=device, dtype=dtype).expand(shape).contiguous().requires_grad_()

    def draw(seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        return attention(q, k, v, dropout_p=p, generator=gen, backend=backend)

    poison_allocator(device)
    try:
        out = draw(1)
    except NotSupportedError as exc:
        outcome.forward = "declined"
        outcome.detail.append(_reasons(exc))
        return
    kept_value = 1.0 / ((1 - p) * n)
    kept = (out.detach().double() - kept_value).abs() <= 1e-2 * kept_value
    zero = out.detach() == 0
    if not (kept | zero).all():
        return outcome.fail("forward", "dropout weights are neither 0 nor 1/((1-p)n)")
    fraction, sigma = float(kept.double().mean()), math.sqrt(p * (1 - p) / kept.numel())
    outcome.forward_ratio = abs(fraction - (1 - p)) / sigma / 5  # <= 1: within 5 sigma
    if outcome.forward_ratio > 1:
        outcome.fail("forward", f"kept fraction {fraction:.4f}, expected {1 - p:.4f} "
                                f"(+- {5 * sigma:.4f})")
    if not torch.equal(draw(1), out):
        outcome.fail("forward", "the same generator seed does not replay bitwise")
    if torch.equal(draw(2), out):
        outcome.fail("forward", "two generator seeds draw the same mask")
    dout = torch.randn_like(out)
    try:
        (dv,) = torch.autograd.grad(out, v, dout)
    except NotSupportedError as exc:
        outcome.backward = "declined"
        outcome.detail.append(f"backward: {_reasons(exc)}")
        return
    group = case.heads_q // case.heads_kv
    expected = out.detach().double().transpose(-1, -2) @ dout.double()
    expected = expected.view(case.batch, case.heads_kv, group, n, n).sum(2)
    err = float((dv.double() - expected).abs().max() / expected.abs().max())
    outcome.backward = "pass"
    outcome.backward_ratio = err / (10 * _ERROR_FLOOR[dtype] + 4 * torch.finfo(dtype).eps)
    if outcome.backward_ratio > 1:
        outcome.fail("backward", f"dv disagrees with the forward's dropout mask (rel. error "
                                 f"{err:.2e})")


def run_case(case: Case, backend: str, dtype: torch.dtype, device: torch.device) -> Outcome:
    """Run ``case`` on ``backend`` in ``dtype``; never raises for an engine's misbehaviour."""
    outcome = Outcome(case, backend, str(dtype).removeprefix("torch."))
    start = time.perf_counter()
    try:
        judge = _judge_dropout if case.dropout_p > 0 else _judge
        judge(outcome, case, backend, dtype, device)
    except Exception as exc:  # an engine crash is a failure to report, not to raise
        outcome.fail("backward" if outcome.forward == "pass" and case.backward and
                     outcome.forward_ratio is not None else "forward",
                     f"{type(exc).__name__}: {exc}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    outcome.seconds = time.perf_counter() - start
    return outcome
