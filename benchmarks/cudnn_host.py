"""Host microseconds per call of the cuDNN engine, measured on the CPU (no GPU needed).

Run from the repository root:  python benchmarks/cudnn_host.py [--calls N] [--json | --json-to DIR]

What a call costs the host before and after cuDNN's ``execute``: ``cudnn_attn.attention(...,
backend="cudnn")`` runs with a host-only stand-in for cuDNN (graphs whose ``execute`` binds the
buffers and returns; a handle object; CPU tensors playing the device, ``Padding`` tensors kept as
runtime lengths), so every line of the engine's Python -- the call cache, the plan, the buffer
binding, the handle and workspace lookups, the allocations, autograd -- runs and is timed, and
cuDNN's own kernel launch is not. The same tiny problem (1 x 2 x 16 x 64 fp16, causal) in:

  fwd            no grad
  fwd (grad)     inputs require grad (records the autograd node, saves what the backward needs)
  fwd+bwd        that, plus ``torch.autograd.grad`` of the output
  padding        static ``Padding`` lengths (ints)
  padding-rt     runtime ``Padding`` lengths (tensors: never read on the host)
  dropout        dropout_p = 0.1 (the seed drawn, the Philox inputs bound)
  bias           an additive [1, 2, 16, 16] bias
  kvcache decode attention_with_kvcache: one query per sequence against a dense cache of S
                 tokens, device lengths (against torch's padded call)
  paged decode   the same through a block table over pages of 4 tokens
  varlen         attention_varlen: the S tokens packed as sequences of 12 and 4, device
                 offsets, causal (against torch's padded call)
  flash_attn_func fwd+bwd, flash_attn_varlen_func fwd+bwd
                 FlashAttention's differentiable functions (its layout; packed as varlen),
                 causal, forward and ``torch.autograd.grad`` (against torch's fwd+bwd)
  flash_attn_with_kvcache decode
                 the kvcache decode step through FlashAttention's API (Hugging Face's
                 flash_attention_2 decode): bitwise repeatable, so cuDNN runs it as a two-row
                 graph (``graphs.decode_rows``; against torch's padded call)
  new shape      one query against keys one longer at every call (a decode loop over a growing
                 cache, as Hugging Face's dynamic cache calls it), 1024 lengths in turn, more
                 than any cache keeps: every call plans anew, on its length bucket's graph
                 after the first 8 shapes (``graphs.length_buckets``; against torch's fwd)

and, as the bar to clear, torch SDPA's own dispatch on this CPU for the smallest call of the same
kind (1 x 1 x 1 x 8, fp32, causal: what it costs beyond arithmetic), no grad / grad / fwd+bwd,
and the same kinds as a torch user writes them: padding (the boolean mask built from the
lengths, then ``attn_mask=``), dropout (``dropout_p=0.1``), bias (a float ``attn_mask``). On the
CPU torch runs those through its math path, whose masking and dropout are host arithmetic too:
a bar that is lower on a GPU, where they are one fused kernel's work;
the Python that runs per ``execute`` of a built graph in front of cuDNN's C++ call ("frontend
dispatch": the frontend's ``pygraph.execute`` and ``graphs.ordered_launch``, which the engine uses,
on the tiny call's forward graph planned deviceless for an H100, the C++ entries stubbed; the
stand-in graphs above have no such dispatch, so on a GPU ours costs that much more than here);
and, for scale, the floor of any engine written in Python: a minimal ``torch.autograd.Function``
that allocates out and lse and returns three gradients ("python floor"). ``kernels``: the device
kernels one call of ours launches besides cuDNN's (``small_kernels``: its aten ops, less views,
allocations and host scalars), each a launch's host time on a GPU.
The issue's target (issue 35): ours at most torch's. Timings are the minimum over rounds of the
mean per call (host time is noise-free from below), every case timed once per round so that all
meet the machine's slow and fast phases alike. JSON: benchmarks/results/cudnn_host-<date>.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import timeit
import types
from pathlib import Path

import _report  # benchmarks/_report.py (this script's folder is on sys.path)
import varlen_rows  # torch's padded mask as its users make it

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend
import torch

# Small, so that the CPU's arithmetic on the few elementwise ops (masking padded rows) stays out
# of the figures: their host cost does not depend on the size.
SHAPE = (1, 2, 16, 64)


EXECUTED = [0]  # graph executions, all graphs together


class HostOnlyGraph:
    """A built cuDNN graph's stand-in: ``execute`` takes what ``pygraph.execute`` takes, checks
    one buffer per uid (a missing binding fails loudly) and counts the call, nothing else."""

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        if len(buffers) != len(tensor_uids):
            raise AssertionError("one buffer per uid")
        EXECUTED[0] += 1

    def get_workspace_size(self):
        return 1 << 20


def install() -> None:
    """Route ``backend="cudnn"`` through host-only graphs on this CPU (process-wide: a benchmark
    process, not a library)."""
    import cudnn_attn as ca
    from cudnn_attn.core import dispatch
    from cudnn_attn.graphs import _emit, _runtime
    from cudnn_attn.graphs import backend as cudnn_backend
    from cudnn_attn.graphs._spec import analyze
    from cudnn_attn.graphs.sdpa import BuiltGraph
    from cudnn_attn.model import masks
    from cudnn_attn.packed import calls

    def build(problem, spec, backward):
        inputs, outputs = _emit.io_uids(spec, backward)
        return BuiltGraph(HostOnlyGraph(), spec, backward, inputs, outputs, 1 << 20, True)

    fake_cudnn = types.SimpleNamespace(create_handle=lambda: object(),
                                       set_stream=lambda handle, stream: None)
    sys.modules["cudnn"] = fake_cudnn  # type: ignore[assignment]  # the handle calls only
    cudnn_backend.build_graph = build
    engine = dispatch.get_backend("cudnn")
    engine.supports = lambda problem: analyze(problem)[1]
    masks._runtime_lengths = lambda value: isinstance(value, torch.Tensor)
    calls.on_accelerator = lambda t: isinstance(t, torch.Tensor)  # KV-cache lengths stay unread
    # The CUDA queries a call makes, answered for "device 0, its default stream".
    _runtime.raw_stream = lambda index: 0
    _runtime._current_device = lambda: 0  # (absent before issue 35: harmless)
    _runtime.capturing = lambda: False
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda index: _Null()
    ca.clear_caches()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def per_call_us(cases: dict, calls: int, repeats: int) -> dict:
    """Microseconds per call of each case: the minimum over ``repeats`` rounds of the mean of
    ``calls`` calls, every case once per round (this machine drifts between a fast and a slow
    phase for seconds at a time: interleaved, the cases meet the same phases)."""
    for fn in cases.values():
        for _ in range(max(10, calls // 10)):
            fn()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, fn in cases.items():
            best[name] = min(best[name], timeit.timeit(fn, number=calls) / calls)
    return {name: 1e6 * seconds for name, seconds in best.items()}


def ours() -> dict:
    import cudnn_attn as ca
    from cudnn_attn.varlen import attention_varlen, attention_with_kvcache

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SHAPE, generator=gen).to(torch.float16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(SHAPE, generator=gen).to(torch.float16)
    bias = torch.randn(1, SHAPE[1], SHAPE[2], SHAPE[2], generator=gen).to(torch.float16)
    causal = ca.Causal()
    static = causal & ca.Padding([12])
    runtime = causal & ca.Padding(torch.tensor([12]))

    def fwd_bwd():
        out = ca.attention(qg, kg, vg, mask=causal, backend="cudnn")
        torch.autograd.grad(out, (qg, kg, vg), dout)

    # One decode step: a query per sequence against a KV cache of S tokens (its bshd pools),
    # with device lengths; paged: pages of 4 tokens through a block table.
    batch, heads, seq, dim = SHAPE
    step = torch.randn(batch, 1, heads, dim, generator=gen).to(torch.float16)
    cache = torch.randn(batch, seq, heads, dim, generator=gen).to(torch.float16)
    pools = cache.view(batch * seq // 4, 4, heads, dim)
    table = torch.arange(batch * seq // 4, dtype=torch.int32).view(batch, -1)
    cache_lens = torch.full((batch,), 12, dtype=torch.int32)
    bottom_right = ca.Causal("bottom_right")
    # Packed sequences of 12 and 4 tokens (the same tokens as q), device offsets.
    packed = q.transpose(1, 2).reshape(batch * seq, heads, dim).contiguous()  # as a user has it
    offsets = torch.tensor([0, 12, seq], dtype=torch.int32)

    # FlashAttention's differentiable functions on the same tokens (bshd; packed), causal.
    from cudnn_attn.compat.flash_attn.functions import flash_attn_func, flash_attn_varlen_func
    from cudnn_attn.flash_attn_interface import flash_attn_with_kvcache

    fa_q, fa_k, fa_v = (t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    fa_dout = dout.transpose(1, 2).contiguous()
    packed_g = [t.view(batch * seq, heads, dim) for t in (fa_q, fa_k, fa_v)]

    def fa_fwd_bwd():
        out = flash_attn_func(fa_q, fa_k, fa_v, causal=True)
        torch.autograd.grad(out, (fa_q, fa_k, fa_v), fa_dout)

    def fa_varlen_fwd_bwd():
        out = flash_attn_varlen_func(*packed_g, offsets, offsets, 12, 12, causal=True)
        torch.autograd.grad(out, (fa_q, fa_k, fa_v), fa_dout.view(out.shape))

    # A growing cache: every call a shape no cache holds (1024 lengths in turn).
    lengths = itertools.cycle(range(seq + 1, seq + 1025))
    growing = torch.randn(batch, seq + 1024, heads, dim, generator=gen).to(torch.float16)

    def new_shape():
        keys = growing[:, :next(lengths)]
        return ca.attention(step, keys, keys, mask=bottom_right, layout="bshd", backend="cudnn")

    cases = {
        "fwd": lambda: ca.attention(q, k, v, mask=causal, backend="cudnn"),
        "fwd (grad)": lambda: ca.attention(qg, kg, vg, mask=causal, backend="cudnn"),
        "fwd+bwd": fwd_bwd,
        "padding": lambda: ca.attention(q, k, v, mask=static, backend="cudnn"),
        "padding-rt": lambda: ca.attention(q, k, v, mask=runtime, backend="cudnn"),
        "dropout": lambda: ca.attention(q, k, v, mask=causal, dropout_p=0.1, backend="cudnn"),
        "bias": lambda: ca.attention(q, k, v, mask=causal, bias=bias, backend="cudnn"),
        "kvcache decode": lambda: attention_with_kvcache(step, cache, cache, cache_lens,
                                                         mask=bottom_right, backend="cudnn"),
        "paged decode": lambda: attention_with_kvcache(step, pools, pools, cache_lens,
                                                       block_table=table, mask=bottom_right,
                                                       backend="cudnn"),
        "varlen": lambda: attention_varlen(packed, packed, packed, offsets, offsets, 12, 12,
                                           mask=causal, backend="cudnn"),
        "flash_attn_func fwd+bwd": fa_fwd_bwd,
        "flash_attn_varlen_func fwd+bwd": fa_varlen_fwd_bwd,
        "flash_attn_with_kvcache decode": lambda: flash_attn_with_kvcache(
            step, cache, cache, cache_seqlens=cache_lens, causal=True),
        "new shape": new_shape,
    }
    return {f"ours {name}": fn for name, fn in cases.items()}


def torch_sdpa() -> dict:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1, 8, generator=gen) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(1, 1, 1, 8, generator=gen)

    def fwd_bwd():
        out = sdpa(qg, kg, vg, is_causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    lengths, positions = torch.tensor([1]), torch.arange(1)
    bias = torch.randn(1, 1, 1, 1, generator=gen)

    def padded():
        return sdpa(q, k, v, attn_mask=varlen_rows.padded_mask(positions, lengths))

    cases = {"fwd": lambda: sdpa(q, k, v, is_causal=True),
             "fwd (grad)": lambda: sdpa(qg, kg, vg, is_causal=True),
             "fwd+bwd": fwd_bwd,
             "padding": padded,
             "dropout": lambda: sdpa(q, k, v, dropout_p=0.1, is_causal=True),
             "bias": lambda: sdpa(q, k, v, attn_mask=bias)}
    return {f"torch sdpa {name}": fn for name, fn in cases.items()}


class _Floor(torch.autograd.Function):
    """The least a Python autograd wrapper of one fused kernel does: allocate out and lse, save
    the inputs, return three gradients (what any engine written in Python pays per call)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def python_floor() -> dict:
    """``_Floor`` on the same tensors: forward with grad, and forward + backward."""
    gen = torch.Generator().manual_seed(0)
    qg, kg, vg = (torch.randn(SHAPE, generator=gen).to(torch.float16).requires_grad_(True)
                  for _ in range(3))
    dout = torch.randn(SHAPE, generator=gen).to(torch.float16)

    def fwd_bwd():
        out, _ = _Floor.apply(qg, kg, vg)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    cases = {"fwd (grad)": lambda: _Floor.apply(qg, kg, vg), "fwd+bwd": fwd_bwd}
    return {f"python floor {name}": fn for name, fn in cases.items()}


class _StubbedEntries:
    """A lowered C++ graph whose execute entries return at once (every other attribute is the
    real graph's): what remains of an ``execute`` is the Python in front of the C++ call."""

    def __init__(self, lowered):
        self._lowered = lowered

    def __getattr__(self, name):
        return getattr(self._lowered, name)

    def _execute_ordered(self, *args):
        EXECUTED[0] += 1

    def _execute_ordered_pack(self, *args):
        EXECUTED[0] += 1


def frontend_dispatch() -> dict:
    """The Python that runs per ``execute`` of a built graph before cuDNN's C++ call: the
    frontend's ``pygraph.execute`` and the engine's ``ordered_launch`` on the same graph (the
    tiny call's forward, its plan built deviceless for an H100; the C++ entries stubbed)."""
    import importlib.util

    if importlib.util.find_spec("cudnn") is None:
        print("frontend dispatch: not measured (nvidia-cudnn-frontend is not installed)")
        return {}
    import cudnn_attn as ca
    from cudnn_attn.graphs import sdpa, targets
    from cudnn_attn.graphs.ordered_launch import launcher
    from cudnn_attn.model.problem import AttnProblem

    meta = torch.empty(SHAPE, dtype=torch.float16, device="meta")
    built = sdpa.build_forward(AttnProblem.from_tensors(meta, meta, meta, mask=ca.Causal()),
                               target=targets.target("h100"))
    graph, order = built.graph, built.order
    graph._lowered_graph = _StubbedEntries(graph._lowered_graph)
    buffers = [torch.empty(1) for _ in order]
    launch = launcher(graph, order)
    return {"frontend dispatch: pygraph.execute":
            lambda: graph.execute(buffers, None, handle=None, tensor_uids=order),
            "frontend dispatch: ordered launch": lambda: launch(buffers, None, None)}


# Ops that launch no device kernel: views and metadata, allocations, and the host tensors the
# engine makes itself (pass-by-value scalars, the Philox seed drawn on the host and read there,
# returned seed tensors).
_NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "as_strided", "expand", "t",
              "transpose", "permute", "unbind", "split", "detach", "alias", "unsqueeze",
              "squeeze", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh",
              "scalar_tensor", "full", "randint", "_local_scalar_dense"}


def small_kernels(fn) -> int:
    """The device kernels one call of ``fn`` launches besides cuDNN's graph executes (which the
    stand-in runs without an op): the aten ops it dispatches, less those in ``_NO_KERNEL``.
    Counted under a dispatch mode, which the engine would take for a traced call: the count
    runs with that check answering "no mode", so the call takes the path it takes when timed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cudnn_attn import api

    counted = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_KERNEL:
                counted[0] += 1
            return func(*args, **(kwargs or {}))

    modes = api._dispatch_modes
    api._dispatch_modes = lambda: 0
    try:
        with Count():
            fn()
    finally:
        api._dispatch_modes = modes
    return counted[0]


# ours' cases measured against torch's call of another name: a decode step is a padded call
# (the lengths made into a mask, attn_mask=) for a torch user
_KIND = {"kvcache decode": "padding", "paged decode": "padding", "varlen": "padding",
         "flash_attn_with_kvcache decode": "padding",
         "flash_attn_func fwd+bwd": "fwd+bwd", "flash_attn_varlen_func fwd+bwd": "fwd+bwd",
         "new shape": "fwd"}


def add_ratios(rows: list[dict]) -> None:
    """``vs_torch``: ours over torch's row of the same kind (runtime padding: torch's padding,
    whose lengths are tensors too)."""
    torch_us = {r["call"].removeprefix("torch sdpa "): r["us_per_call"] for r in rows
                if r["call"].startswith("torch")}
    for row in rows:
        for prefix in ("ours ", "python floor "):
            if row["call"].startswith(prefix):
                case = row["call"].removeprefix(prefix).removesuffix("-rt")
                kind = _KIND.get(case, case)
                row["vs_torch"] = row["us_per_call"] / torch_us[kind]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per case and round")
    parser.add_argument("--repeats", type=int, default=15, help="rounds (every case once each)")
    parser.add_argument("--json", action="store_true",
                        help="also write the results file (benchmarks/results)")
    parser.add_argument("--json-to", type=Path, default=None,
                        help="write the results file into this folder instead")
    args = parser.parse_args()
    dispatch = frontend_dispatch()  # the real frontend, before install() stands in for it
    install()
    torch.set_grad_enabled(True)
    cases = {**torch_sdpa(), **python_floor(), **ours(), **dispatch}
    timed = per_call_us(cases, args.calls, args.repeats)
    rows = [{"call": name, "us_per_call": us} for name, us in timed.items()]
    add_ratios(rows)
    for row, fn in zip(rows, cases.values()):
        if row["call"].startswith("ours "):
            row["kernels"] = small_kernels(fn)
    _report.print_table(rows, ["call", "us_per_call", "vs_torch", "kernels"])
    print(f"(the stand-in executed {EXECUTED[0]} graph calls)")
    if args.json or args.json_to is not None:
        path = _report.write_json("cudnn_host", {"shape": list(SHAPE), "calls": args.calls,
                                                 "rows": rows},
                                  results_dir=args.json_to or _report.RESULTS_DIR)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
