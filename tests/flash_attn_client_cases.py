"""The cases tests/test_flash_attn_clients.py runs inside each gloo process: ring-flash-attn 0.1.8
and yunchang 0.6.4, unmodified, on cudnn_attn after ``integrations.flash_attn.register()``.

Each case shards bf16 inputs the way the library expects (contiguous, zigzag, stripe, per-sequence
varlen, llama3's packed split), runs the library's function forward and backward, and compares
this rank's shard of the output and of dq/dk/dv with single-process attention on the full tensors:
a float64 brute force (softmax of masked scores), with the bf16 error allowed to be 2x (forward)
/ 3x (backward) that of plain PyTorch attention run in bf16 on the same inputs (+ a small floor).

ring-flash-attn's package ``__init__`` imports its Hugging Face adapter, which needs transformers
4.x (``is_flash_attn_greater_or_equal_2_10``, gone in 5.x). :func:`ring_modules` therefore enters
the package as an empty namespace over its installed directory and imports the attention
submodules directly, so the adapter is never imported; the library's files are run unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import torch
import torch.distributed as dist

import cudnn_attn.integrations.flash_attn as ca_flash_attn

BF16, F64 = torch.bfloat16, torch.float64
HEADS_Q, HEADS_KV, DIM = 4, 2, 16
SEQ = 32                       # dense cases: divisible by 2 * world (zigzag) for world 2
LENS = (12, 28, 24)            # varlen cases: each divisible by 2 * world (zigzag varlen)

# (name, sharding, causal)
CASES = [
    ("ring", "contiguous", True),
    ("ring", "contiguous", False),
    ("zigzag", "zigzag", True),
    ("stripe", "stripe", True),
    ("ring_varlen", "varlen_contiguous", True),
    ("zigzag_varlen", "varlen_zigzag", True),
    ("llama3_varlen", "llama3", True),
    ("llama3_varlen", "llama3", False),
    ("yunchang", "contiguous", True),
    ("yunchang_zigzag", "zigzag", True),
]


def ring_modules():
    """ring-flash-attn's attention modules without its package ``__init__`` (see the module
    docstring)."""
    ca_flash_attn.register()
    if "ring_flash_attn" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
    names = ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn",
             "ring_flash_attn_varlen", "zigzag_ring_flash_attn_varlen", "llama3_flash_attn_varlen")
    return {n: importlib.import_module(f"ring_flash_attn.{n}") for n in names}


# ---------------------------------------------------------------------------------------------
# shardings: each maps full [..., S, ...] (dim 1 dense, dim 0 packed) to this rank's rows
# ---------------------------------------------------------------------------------------------

def _rows(sharding, rank, world, cu):
    """Indices of the full sequence axis this rank holds."""
    total = int(cu[-1]) if cu is not None else SEQ
    index = torch.arange(total)
    if sharding in ("contiguous", "llama3"):
        return index.chunk(world)[rank]
    if sharding == "zigzag":
        chunks = index.chunk(2 * world)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
    if sharding == "stripe":
        return index[rank::world]
    seqs = [index[int(a):int(b)] for a, b in zip(cu[:-1], cu[1:])]
    if sharding == "varlen_contiguous":
        return torch.cat([s.chunk(world)[rank] for s in seqs])
    if sharding == "varlen_zigzag":
        parts = [s.chunk(2 * world) for s in seqs]
        return torch.cat([torch.cat([p[rank], p[2 * world - 1 - rank]]) for p in parts])
    raise ValueError(sharding)


# ---------------------------------------------------------------------------------------------
# single-process references
# ---------------------------------------------------------------------------------------------

def _visible(total, cu, causal):
    """[S, S] boolean: which keys each query sees (per packed sequence when ``cu`` is given)."""
    if cu is None:
        seq_id = torch.zeros(total, dtype=torch.long)
    else:
        seq_id = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu))
    vis = seq_id[:, None] == seq_id[None, :]
    if causal:  # every sequence has as many queries as keys: top-left == bottom-right
        vis &= torch.ones(total, total, dtype=torch.bool).tril()
    return vis


def _attention(q, k, v, vis, dtype):
    """Attention over [S, H, D] (the batch folded away by the caller) computed in ``dtype``."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM ** -0.5
    scores = scores.masked_fill(~vis, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _reference(q, k, v, dout, vis, dtype, batched):
    """(out, dq, dk, dv) of the full problem in ``dtype``; ``batched``: dim 0 is a batch."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if batched:
        out = torch.stack([_attention(*(t[b] for t in leaves), vis, dtype)
                           for b in range(q.shape[0])])
    else:
        out = _attention(*leaves, vis, dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return (out.detach(), *grads)


def _check(name, got, exact, plain, factor):
    """``got`` (bf16) is within ``factor`` x plain bf16's error of the float64 ``exact``."""
    err = (got.to(F64) - exact).abs().max().item()
    base = (plain.to(F64) - exact).abs().max().item()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert err <= factor * base + 2e-3, f"{name}: max error {err:.3g} > {factor} x {base:.3g}"


# ---------------------------------------------------------------------------------------------
# running the libraries
# ---------------------------------------------------------------------------------------------

def _dense_call(name, causal, rank, world):
    if name.startswith("yunchang"):
        import yunchang
        from yunchang.kernels import AttnType

        yunchang.set_seq_parallel_pg(1, world, rank, world)   # ulysses 1, ring degree = world
        impl = "zigzag" if name == "yunchang_zigzag" else "basic"
        layer = yunchang.LongContextAttention(ring_impl_type=impl, attn_type=AttnType.FA)
        return lambda q, k, v: layer(q, k, v, causal=causal)
    mods = ring_modules()
    fn = {"ring": mods["ring_flash_attn"].ring_flash_attn_func,
          "zigzag": mods["zigzag_ring_flash_attn"].zigzag_ring_flash_attn_func,
          "stripe": mods["stripe_flash_attn"].stripe_flash_attn_func}[name]
    return lambda q, k, v: fn(q, k, v, causal=causal)


def _varlen_call(name, causal, rank, world, cu):
    mods = ring_modules()
    if name == "llama3_varlen":
        mod = mods["llama3_flash_attn_varlen"]
        cu_q, cu_k, max_q, max_k, k_slice = mod.llama3_flash_attn_prepare_cu_seqlens(
            cu, causal, rank, world)
        return lambda q, k, v: mod.llama3_flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride=1, local_k_slice=k_slice,
            causal=causal)
    local_cu = cu // world
    max_len = int(torch.diff(local_cu).max())
    fn = {"ring_varlen": mods["ring_flash_attn_varlen"].ring_flash_attn_varlen_func,
          "zigzag_varlen": mods["zigzag_ring_flash_attn_varlen"]
          .zigzag_ring_flash_attn_varlen_func}[name]
    return lambda q, k, v: fn(q, k, v, local_cu, max_len, causal=causal)


def run(case, rank, world):
    name, sharding, causal = case
    ca_flash_attn.register()
    varlen = sharding.startswith("varlen") or sharding == "llama3"
    g = torch.Generator().manual_seed(len(name) * 31 + causal)
    cu = torch.tensor([0, *LENS]).cumsum(0).to(torch.int32) if varlen else None
    lead = (int(cu[-1]),) if varlen else (2, SEQ)
    full = [torch.randn(*lead, h, DIM, generator=g).to(BF16)
            for h in (HEADS_Q, HEADS_KV, HEADS_KV, HEADS_Q)]
    q, k, v, dout = full
    vis = _visible(lead[-1], cu, causal)
    exact = _reference(q, k, v, dout, vis, F64, batched=not varlen)
    plain = _reference(q, k, v, dout, vis, BF16, batched=not varlen)

    rows = _rows(sharding, rank, world, cu)
    axis = 0 if varlen else 1
    local = [t.index_select(axis, rows).contiguous().requires_grad_() for t in (q, k, v)]
    call = _varlen_call(name, causal, rank, world, cu) if varlen else \
        _dense_call(name, causal, rank, world)
    out = call(*local)
    grads = torch.autograd.grad(out, local, dout.index_select(axis, rows))
    for label, got, e, p, factor in zip(("out", "dq", "dk", "dv"), (out, *grads), exact, plain,
                                        (2, 3, 3, 3)):
        _check(f"{name} {label}", got, e.index_select(axis, rows), p.index_select(axis, rows),
               factor)
    dist.barrier()
