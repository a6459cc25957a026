"""The paged-KV decode service behind ``inference_server.py --mode decode``.

A fixed number of batch slots share one page pool (``paged_decode.PagedKVCache``). A request
(``{"prompt_len": n, "new_tokens": m, "seed": s}``) waits for a free slot and enough free pages,
is admitted (all ``ceil((n + m) / page_size)`` pages are reserved at once and its random prompt
K/V written: the prefill), then decodes ``m`` tokens, one per step, together with whatever else
occupies the slots (continuous batching). Every step is one call

    attention_with_kvcache(q [B, 1, H, D], k_pool, v_pool, cache_seqlens (device int32 [B]),
                           block_table=table (device int32 [B, max_blocks]),
                           mask=Causal("bottom_right"))

with ``B`` (the slots), ``max_blocks`` (the cache capacity per sequence) and the pool fixed, so
one graph serves every step whatever the lengths. An idle slot attends to one token of a scratch
page (length 1, never 0) and its output is dropped. ``step()`` is device work only: lengths,
write positions and the oracle's mirror stay on the device (no ``.item()``, no host copies),
so it runs under ``torch.cuda.set_sync_debug_mode("error")``; admission and retirement are host
work between steps.

With ``check`` each step is compared (``compare()``, untimed) with a dense float64 attention over
a contiguous copy of every slot's tokens (``paged_decode.dense_attention``); mismatches are
counted on the device.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import torch
from paged_decode import PagedKVCache, dense_attention

import cudnn_attn as ca
from cudnn_attn.core.dispatch import get_backend
from cudnn_attn.graphs.cache import graph_cache

# auto: the engines in dispatch's priority order; the first that runs the call is the one used
ENGINES = ("cudnn", "cupy", "torch")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2,
             torch.bfloat16: 6e-2}


@dataclass(frozen=True)
class DecodeShape:
    """What fixes the decode graph: slots, heads, head dim, pages, pool, dtype, device."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    max_blocks: int
    num_blocks: int
    dtype: torch.dtype
    device: str

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold (prompt + generated)."""
        return self.max_blocks * self.page_size


class Sequence:
    """One request: its sizes, its slot once admitted, and its answer once done."""

    def __init__(self, prompt_len: int, new_tokens: int, seed: int):
        self.prompt_len, self.new_tokens, self.seed = prompt_len, new_tokens, seed
        self.remaining, self.slot = new_tokens, None
        self.done = threading.Event()
        self.reply: dict | None = None
        self.error: BaseException | None = None


class DecodeService:
    """Continuous-batching paged decode over ``shape.batch`` slots (see the module docstring).

    ``backend``: ``"auto"`` tries the available ``ENGINES``, forced, in order on the first step
    and keeps the first that runs, so the report names the engine for certain (a forced backend
    never falls back). ``check``: compare every step with the oracle.
    """

    def __init__(self, shape: DecodeShape, *, backend: str = "auto", check: bool = False,
                 seed: int = 0):
        if shape.num_blocks < shape.max_blocks + 1:  # a full sequence plus the scratch page
            raise ValueError(f"num_blocks must be >= max_blocks + 1 = {shape.max_blocks + 1}, "
                             f"got {shape.num_blocks}")
        self.shape, self.backend, self.check = shape, backend, check
        self.engine = None if backend == "auto" else backend
        self.declined: dict[str, str] = {}
        B, H, Hkv, D, dev = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.device
        E = H * D
        gen = torch.Generator().manual_seed(seed)

        def randn(*size, std=1.0):
            return (std * torch.randn(*size, generator=gen)).to(dev, shape.dtype)

        # The toy decoder of paged_decode: hidden [B, E] -> q/k/v; out -> the next hidden.
        self.w_qkv = randn(E, (H + 2 * Hkv) * D, std=E ** -0.5)
        self.w_out = randn(E, E, std=E ** -0.5)
        self.hidden = torch.zeros(B, E, device=dev, dtype=shape.dtype)
        self.cache = PagedKVCache(shape.num_blocks, shape.page_size, Hkv, D, B, shape.max_blocks,
                                  device=dev, dtype=shape.dtype, seed=seed)
        self.cache.k.zero_()
        self.cache.v.zero_()
        self.scratch = self.cache.free.pop()  # idle slots read (and write) only this page
        self.k_rows = self.cache.k.view(-1, Hkv, D)  # [num_blocks * page_size, H_kv, D]
        self.v_rows = self.cache.v.view(-1, Hkv, D)
        self.table = torch.full((B, shape.max_blocks), self.scratch, dtype=torch.int32,
                                device=dev)
        self.lens = torch.zeros(B, dtype=torch.int64, device=dev)  # tokens in the cache
        self.active = torch.zeros(B, dtype=torch.int64, device=dev)
        self.sums = torch.zeros(B, dtype=torch.float64, device=dev)  # per-slot output checksum
        self.scale = D ** -0.5
        if check:
            C = shape.capacity
            self.dense_k = torch.zeros(B, C, Hkv, D, device=dev, dtype=torch.float64)
            self.dense_v = torch.zeros_like(self.dense_k)
            self.row_base = torch.arange(B, device=dev) * C
        self.max_err = torch.zeros((), dtype=torch.float64, device=dev)
        self.mismatches = torch.zeros((), dtype=torch.int64, device=dev)
        self.compared = torch.zeros((), dtype=torch.int64, device=dev)
        self.slots: list[Sequence | None] = [None] * B
        self.waiting: list[Sequence] = []
        self.error: BaseException | None = None
        self.signatures: set = set()
        self.step_ms: list[float] = []
        self.steps = self.steps_built = self.tokens = 0
        self.last: tuple = ()
        self._cv = threading.Condition()

    # -- requests ---------------------------------------------------------------------------
    def submit(self, prompt_len: int, new_tokens: int, seed: int = 0) -> Sequence:
        """Queue a sequence; ``ValueError`` when it cannot fit one slot's capacity."""
        if prompt_len < 1 or new_tokens < 1:
            raise ValueError("prompt_len and new_tokens must be >= 1")
        if prompt_len + new_tokens > self.shape.capacity:
            raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the "
                             f"capacity of a slot ({self.shape.capacity} tokens)")
        seq = Sequence(prompt_len, new_tokens, seed)
        with self._cv:
            if self.error is not None:
                raise RuntimeError(f"the decode loop failed: {self.error}")
            self.waiting.append(seq)
            self._cv.notify_all()
        return seq

    def handle(self, request: dict) -> dict:
        """Submit a request (JSON object) and wait for its answer."""
        seq = self.submit(int(request["prompt_len"]), int(request["new_tokens"]),
                          int(request.get("seed", 0)))
        seq.done.wait()
        if seq.error is not None:
            raise RuntimeError(f"decode failed: {seq.error}")
        return seq.reply

    # -- host work between steps ------------------------------------------------------------
    def admit(self) -> int:
        """Prefill waiting sequences into free slots while pages last; how many were admitted."""
        admitted = 0
        P = self.shape.page_size
        while True:
            with self._cv:
                free = [b for b, s in enumerate(self.slots) if s is None]
                if not self.waiting or not free:
                    return admitted
                seq = self.waiting[0]
                if -(-(seq.prompt_len + seq.new_tokens) // P) > len(self.cache.free):
                    return admitted  # first come, first served: wait for pages
                self.waiting.pop(0)
            self._prefill(free[0], seq)
            admitted += 1

    def _prefill(self, b: int, seq: Sequence) -> None:
        s, dev = self.shape, self.shape.device
        gen = torch.Generator().manual_seed(seq.seed)
        k, v = (torch.randn(seq.prompt_len, s.kv_heads, s.head_dim, generator=gen)
                for _ in range(2))
        self.cache.reserve(b, seq.prompt_len + seq.new_tokens)
        self.cache.extend(b, k.to(dev, s.dtype), v.to(dev, s.dtype))
        row = self.cache.block_table[b]
        self.table[b] = torch.where(row >= 0, row, self.scratch).to(dev)
        self.hidden[b] = torch.randn(s.heads * s.head_dim, generator=gen).to(dev, s.dtype)
        self.lens[b], self.active[b], self.sums[b] = seq.prompt_len, 1, 0.0
        if self.check:  # the oracle's contiguous copy, rounded as the cache holds it
            self.dense_k[b].zero_()
            self.dense_v[b].zero_()
            self.dense_k[b, :seq.prompt_len] = k.to(s.dtype).double().to(dev)
            self.dense_v[b, :seq.prompt_len] = v.to(s.dtype).double().to(dev)
        seq.slot = b
        self.slots[b] = seq

    def retire(self) -> None:
        """Count one token for every occupied slot; answer and free the finished ones."""
        for b, seq in enumerate(self.slots):
            if seq is None:
                continue
            self.cache.lens[b] += 1
            seq.remaining -= 1
            if seq.remaining:
                continue
            seq.reply = {"slot": b, "prompt_len": seq.prompt_len, "new_tokens": seq.new_tokens,
                         "checksum": float(self.sums[b])}
            self.cache.release(b)
            self.table[b] = self.scratch
            self.lens[b], self.active[b] = 0, 0
            self.slots[b] = None
            seq.done.set()

    # -- one decode step: device work only ---------------------------------------------------
    def step(self) -> torch.Tensor:
        """One token for every slot; ``out`` ``[B, 1, H, D]`` (idle slots' rows are junk)."""
        s = self.shape
        B, H, Hkv, D, P = s.batch, s.heads, s.kv_heads, s.head_dim, s.page_size
        qkv = (self.hidden @ self.w_qkv).view(B, H + 2 * Hkv, D)
        q, k, v = qkv.split((H, Hkv, Hkv), dim=1)
        pos = self.lens  # where this token goes; an idle slot (0) writes the scratch page
        page = self.table.gather(1, (pos // P)[:, None])[:, 0].long()
        rows = page * P + pos % P
        self.k_rows.index_copy_(0, rows, k)
        self.v_rows.index_copy_(0, rows, v)
        seqlens = (pos + 1).to(torch.int32)
        # Contiguous q: the same strides as the zero-filled q of `cudnn-attn cache warm`.
        out = self._attend(q[:, None].contiguous(), seqlens)
        self.sums += out.flatten(1).double().sum(1) * self.active
        self.last = (q, k, v, pos, seqlens, out[:, 0], self.active.clone())
        self.hidden = torch.nn.functional.layer_norm(
            self.hidden + out.reshape(B, H * D) @ self.w_out, (H * D,))
        self.lens = self.lens + self.active  # a new tensor: ``pos`` stays this step's positions
        return out

    def _attend(self, q: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
        self.signatures.add((tuple(q.shape), q.stride(), tuple(self.cache.k.shape),
                             tuple(self.table.shape), seqlens.dtype, q.dtype))
        if self.engine is not None:
            return self._call(q, seqlens, self.engine)
        for name in ENGINES:
            missing = get_backend(name).availability()  # no CUDA, no cuDNN, no CuPy: skip it
            if missing:
                self.declined[name] = "; ".join(missing)
                continue
            try:
                out = self._call(q, seqlens, name)
            except ca.NotSupportedError as exc:
                self.declined[name] = "; ".join(exc.reasons.get(name) or [str(exc)])
                continue
            self.engine = name
            return out
        raise ca.NotSupportedError("a paged decode step",
                                   {name: [why] for name, why in self.declined.items()})

    def _call(self, q, seqlens, backend):
        return ca.attention_with_kvcache(q, self.cache.k, self.cache.v, seqlens,
                                         block_table=self.table, mask=ca.Causal("bottom_right"),
                                         backend=backend)  # the default scale, D ** -0.5

    def compare(self) -> None:
        """Check the last step against dense float64 attention over the oracle's contiguous
        copy (device work only; counted in ``max_err``/``mismatches``, read by ``stats()``)."""
        q, k, v, pos, seqlens, out, active = self.last
        flat = self.row_base + pos
        Hkv, D = self.shape.kv_heads, self.shape.head_dim
        self.dense_k.view(-1, Hkv, D).index_copy_(0, flat, k.double())
        self.dense_v.view(-1, Hkv, D).index_copy_(0, flat, v.double())
        ref = dense_attention(q, self.dense_k, self.dense_v, seqlens, self.scale)
        err = (out.double() - ref).abs().flatten(1).amax(1) * active  # idle slots: 0
        self.max_err = torch.maximum(self.max_err, err.max())
        self.mismatches += (err > TOLERANCE[self.shape.dtype]).sum()
        self.compared += active.sum()

    # -- the serving loop --------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Admit, step, retire until ``stop`` is set and nothing is left; times every step."""
        cuda = self.shape.device.startswith("cuda")
        try:
            while True:
                with self._cv:
                    while not (self.waiting or any(self.slots) or stop.is_set()):
                        self._cv.wait(0.05)
                    if stop.is_set() and not self.waiting and not any(self.slots):
                        return
                self.admit()
                if not any(self.slots):
                    continue
                before = graph_cache.info()["builds"]
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                self.step()
                if cuda:
                    torch.cuda.synchronize()
                self.step_ms.append(1e3 * (time.perf_counter() - start))
                if self.check:  # not timed, as in paged_decode
                    self.compare()
                self.steps += 1
                self.tokens += sum(s is not None for s in self.slots)
                self.steps_built += graph_cache.info()["builds"] > before
                self.retire()
        except Exception as exc:  # noqa: BLE001 (answer everyone instead of leaving them waiting)
            with self._cv:
                self.error = exc
                pending = self.waiting + [s for s in self.slots if s is not None]
                self.waiting = []
            for seq in pending:
                seq.error = exc
                seq.done.set()

    def stats(self) -> dict:
        """Steps, tokens, step latency, engine, the oracle's verdict (reads device counters)."""
        steps = max(self.steps, 1)
        signatures = len(self.signatures)
        return {
            "engine": self.engine, "declined": self.declined, "steps": self.steps,
            "tokens": self.tokens, "call_signatures": signatures,
            "steps_with_graph_builds": self.steps_built,
            "signature_hit_rate": (self.steps - signatures) / steps if self.steps else 0.0,
            "step_p50_ms": percentile(self.step_ms, 50), "step_p99_ms": percentile(self.step_ms, 99),
            "step_mean_ms": statistics.fmean(self.step_ms) if self.step_ms else 0.0,
            "tokens_per_s": self.tokens / (sum(self.step_ms) / 1e3) if self.step_ms else 0.0,
            "compared_tokens": int(self.compared) if self.check else None,
            "mismatches": int(self.mismatches) if self.check else None,
            "max_err": float(self.max_err) if self.check else None,
        }


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]
