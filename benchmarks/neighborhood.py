"""GPU benchmark: fused neighborhood attention (the CuPy engine) vs FlexAttention, NATTEN and dense SDPA.

Run from the repository root on a CUDA machine:  python benchmarks/neighborhood.py [--quick]
Without CUDA it says so and exits 0, writing nothing.

Problems (non-causal, stride 1, dilation 1; B=1, H = 2048 / D, fp16/bf16, D in {64, 128}):
1-D L=32768 k=2048, 2-D 128x128 k=31x31, 3-D 32x32x32 k=7x7x7. Forward and backward, useful
TFLOP/s = 4 * B * H * N * |window| * D / time (|window| = prod(kernel); backward 2.5x that). For
each we time
  * ours:        cudnn_attn.neighborhood.na{n}d (heads-last), served by the cupy backend (the
                 dispatcher's choice is checked; another engine is recorded as an error)
  * flex:        torch.nn.attention.flex_attention, compiled, with the block mask of the NATTEN rule
                 (``natten_mask_mod`` below), [B, H, N, D]
  * natten-flex: natten.na{n}d(..., backend="flex-fna", torch_compile=True), when natten imports
  * sdpa-cudnn / sdpa-flash: dense SDPA on the same tokens (sdpa_kernel); their TFLOP/s count the
                 dense 4 * B * H * N^2 * D, so compare them by milliseconds
A peer that cannot run is recorded as an error string, never a crash. Target (issue 4): H200,
bf16, D=128, 2-D 128x128 k=31x31 forward: ours >= 250 TFLOP/s and >= 1.5x Flex. The machine's
ceilings (benchmarks/ceilings.py) are measured once per run; rows get ``ours/ceiling`` (ours over
the bf16 matmul ceiling).
Beside every row, the tile model's figures (``cudnn_attn.fallback_kernels.tile_model``, issue
34): the boxes ``choose_tiles`` launches, useful %, tile pairs (unmasked / masked), predicted ms
of the fused kernels and of dense cuDNN (plain, and with the exact mask as ``auto`` would run it),
the engine the cost rule picks, and measured/predicted ratios. ``--model-only`` prints the model
for issue 34's problems without a GPU.
JSON: <--results-dir>/neighborhood-<date>.json (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import _report  # benchmarks/_report.py (this script's folder is on sys.path)
import ceilings
import torch

PROBLEMS = {  # rank: (spatial shape, kernel size)
    1: ((32768,), (2048,)),
    2: ((128, 128), (31, 31)),
    3: ((32, 32, 32), (7, 7, 7)),
}
HIDDEN = 2048
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TARGET_TFLOPS, TARGET_VS_FLEX = 250.0, 1.5  # bf16, D=128, 2-D 128x128 k=31x31, forward
ENGINES = ("ours", "ours-wgmma", "ours-64", "ours-wide", "flex", "natten-flex", "sdpa-cudnn",
           "sdpa-flash")
DEVICE, OURS_BACKEND = "cuda", "cupy"  # module constants so a CPU smoke run can swap them
# A compiled peer's setup (block mask, torch.compile) and first call get this long; past it the
# peer is recorded as timed out (issue 23: Flex's compile ate the whole 162 s share of the run).
PEER_SETUP_S = 90.0
PEERS = ("flex", "natten-flex")  # measured after ours and the dense SDPA rows
# ours' variants (the same call on other kernels) and their max |variant - ours| forward column
VARIANT_COLUMNS = {"ours-wgmma": "max|wgmma-ours|", "ours-64": "max|64-ours|",
                   "ours-wide": "max|wide-ours|"}
# Issue 34's problems (spatial, kernel, heads, D; B=1, bf16) and what the latest H200 record
# measured (results/neighborhood-2026-11-29.json and more/: forward ms per call back to back,
# ours and dense cuDNN over all tokens; the two small problems' ours is the host's pace).
ISSUE_PROBLEMS = [((128, 128), (31, 31), 16, 128, 1.101, 3.529),
                  ((128, 128), (7, 7), 8, 128, 0.401, 1.776),
                  ((64, 64), (13, 13), 16, 64, 0.472, 0.152),
                  ((32768,), (2048,), 16, 128, 2.523, 14.651),
                  ((32, 32, 32), (7, 7, 7), 16, 128, 1.831, 14.619)]


def issue_only_problems() -> list:
    """``ISSUE_PROBLEMS`` whose (spatial, kernel) ``PROBLEMS`` does not measure already."""
    measured = set(PROBLEMS.values())
    return [p for p in ISSUE_PROBLEMS if (p[0], p[1]) not in measured]


MODEL_COLUMNS = ["model_boxes", "model_useful_%", "model_pairs", "model_unmasked_%",
                 "model_fused_ms", "model_dense_ms", "model_dense_mask_ms", "model_pick"]


class PeerTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raise ``PeerTimeout`` in this (main) thread after ``seconds``."""
    def expire(signum, frame):
        raise PeerTimeout(f"{what} took more than {seconds:.0f} s (setup, compile, first call)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def natten_mask_mod(spatial, kernel, dilation=None, causal=None):
    """A Flex ``mask_mod`` of NATTEN's rule (stride 1) on the row-major flattening of ``spatial``.

    Per axis (length L, kernel k, dilation d): the key must share the query's dilation group
    ``g = i % d``; inside the group (length ``Lg = ceil((L - g) / d)``) the query ``qi = i // d``
    sees ``[c - k//2, c + (k - 1 - k//2)]`` with ``c = clamp(qi, k//2, Lg - 1 - (k - 1 - k//2))``,
    or, when causal, ``[max(qi - k + 1, 0), qi]``. Works on broadcastable index tensors.
    """
    rank = len(spatial)
    dilation = dilation or (1,) * rank
    causal = causal or (False,) * rank
    strides = [math.prod(spatial[a + 1:]) for a in range(rank)]

    def axis(i, j, length, k, d, c):
        g = i % d
        qi, kj = i // d, j // d
        same_group = (j % d) == g
        if c:
            return same_group & (kj <= qi) & (kj >= torch.clamp(qi - k + 1, min=0))
        wl, wr = k // 2, k - 1 - k // 2
        group_len = (length - g + d - 1) // d
        centre = torch.minimum(torch.clamp(qi, min=wl), group_len - 1 - wr)
        return same_group & (kj >= centre - wl) & (kj <= centre + wr)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = None
        for a in range(rank):
            i = (q_idx // strides[a]) % spatial[a]
            j = (kv_idx // strides[a]) % spatial[a]
            v = axis(i, j, spatial[a], kernel[a], dilation[a], causal[a])
            visible = v if visible is None else visible & v
        return visible

    return mask_mod


def na_flops(batch, heads, spatial, kernel, dim, direction):
    f = 4.0 * batch * heads * math.prod(spatial) * math.prod(kernel) * dim
    return f * (2.5 if direction == "bwd" else 1.0)


def dense_flops(batch, heads, tokens, dim, direction):
    return 4.0 * batch * heads * tokens * tokens * dim * (2.5 if direction == "bwd" else 1.0)


def model_rows(spatial, kernel, batch, heads, dim, dtype, ceilings, capability=None):
    """``{"fwd": {...}, "bwd": {...}}``: the tile model's figures for one problem (``model_*``
    keys; bwd is the backward alone, as the rows time it), with ``ceilings`` a
    ``roofline.Ceilings`` and the kernels and boxes launched on a device of ``capability``
    (default: the ceilings' GPU). ``model_boxes``: query box / key box of the forward, and of dQ
    then dK/dV for the backward."""
    from cudnn_attn.core import roofline
    from cudnn_attn.fallback_kernels import tile_model
    from cudnn_attn.graphs.score_mod_masks import mask_program
    from cudnn_attn.model.geometry import neighborhood_table
    from cudnn_attn.model.masks import Neighborhood

    rank = len(spatial)
    table = tuple(neighborhood_table(spatial, kernel, (1,) * rank, (1,) * rank, (False,) * rank))
    launch = tile_model.launch_figures(table, rank, capability or ceilings.capability,
                                       dim_qk=dim, dtype=dtype, batch=batch, heads=heads)
    tokens = math.prod(spatial)
    shape = dict(batch=batch, heads=heads, heads_kv=heads, seq_q=tokens, seq_kv=tokens,
                 dim_qk=dim, dim_v=dim, dtype=dtype)
    mask_ops = len(mask_program(neighborhood=Neighborhood(spatial, kernel)).ops)

    def boxes(figures):
        return "x".join(map(str, figures.query_box)) + "/" + "x".join(map(str, figures.key_box))

    out = {}
    for direction, kernels in tile_model.DIRECTION_KERNELS.items():
        walks = [launch.kernel_figures(k) for k in kernels]
        fused = launch.predicted_ms(direction, ceilings)
        dense_mask = roofline.dense_ms(direction, ceilings=ceilings, mask_ops=mask_ops, **shape)
        pairs = sum(f.tile_pairs for f in walks)
        unmasked = sum(f.unmasked_pairs for f in walks)
        out[direction] = {"model_boxes": " ".join(boxes(f) for f in walks),
                          "model_useful_%": 100 * launch.useful_fraction(direction),
                          "model_pairs": pairs, "model_unmasked_pairs": unmasked,
                          "model_masked_pairs": pairs - unmasked,
                          "model_unmasked_%": 100 * unmasked / pairs if pairs else 0.0,
                          "model_ceilings": ceilings.name, "model_fused_ms": fused,
                          "model_dense_ms": roofline.dense_ms(direction, ceilings=ceilings,
                                                              **shape),
                          "model_dense_mask_ms": dense_mask,
                          "model_pick": ("cupy" if tile_model.paced_ms(fused, direction)
                                         < dense_mask else "cudnn"),  # auto's rule
                          "model_bytes": launch.total("bytes", direction),
                          "model_computed_flops": launch.total("computed_flops", direction),
                          "model_useful_flops": launch.query_major.useful_flops[direction]}
    return out


def add_model_ratios(row):
    """measured/predicted: ``ours/model`` (fused kernels), ``sdpa-cudnn/model`` (plain dense)."""
    for measured, predicted, column in (("ours_ms", "model_fused_ms", "ours/model"),
                                        ("sdpa-cudnn_ms", "model_dense_ms", "sdpa-cudnn/model")):
        if row.get(measured) and row.get(predicted):
            row[column] = row[measured] / row[predicted]


def print_model_only(ceilings_name: str) -> int:
    """The model's table for issue 34's problems (bf16, B=1): no GPU needed."""
    from cudnn_attn.core import roofline

    ceilings = roofline.DEVICE_CEILINGS[ceilings_name]
    rows = []
    for spatial, kernel, heads, dim, ours, dense in ISSUE_PROBLEMS:
        name = f"{len(spatial)}-D {'x'.join(map(str, spatial))} k={'x'.join(map(str, kernel))}"
        for direction, figures in model_rows(spatial, kernel, 1, heads, dim, torch.bfloat16,
                                             ceilings).items():
            row = {"problem": name, "H": heads, "D": dim, "dir": direction, **figures}
            if direction == "fwd":
                row.update({"issue_ours_ms": ours, "issue_dense_ms": dense})
            rows.append(row)
    _report.print_table(rows, ["problem", "H", "D", "dir", *MODEL_COLUMNS, "issue_ours_ms",
                               "issue_dense_ms"])
    print(f"tile model on {ceilings_name} ceilings ({ceilings.bandwidth / 1e12:.1f} TB/s, "
          f"{ceilings.matmul / 1e12:.0f} TFLOP/s bf16); fused: today's kernels' efficiencies "
          "(tile_model.FUSED_EFFICIENCY); dense: cuDNN over all tokens, plain and with the exact "
          "mask (score_mod); pick: auto's cost rule; issue_*: issue 34's H200 forward rows")
    return 0


def timed(fn, args):
    """Median ms per call, about 50 ms per timed batch."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    number = max(1, min(100, int(0.05 / max(time.perf_counter() - start, 1e-6))))
    return _report.time_ms(fn, warmup=args.warmup, repeats=args.repeats, number=number,
                           sync=torch.cuda.synchronize)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _leaves(tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def engines(rank, spatial, kernel, q, k, v):
    """``{engine: setup}`` in measuring order (ours and its forced variants, the dense SDPA rows,
    then the compiled peers); ``setup()`` returns ``(leaves, forward closure)``, or ``(leaves,
    forward closure, scope)`` where ``scope()`` is a context the engine's forward and backward
    both run in; it may raise.

    ``q, k, v`` are heads-last ``[B, *spatial, H, D]``. A closure returns the output, heads-last
    for ours/natten, heads-first for the others. (Closures bind their leaves as default arguments:
    the names are reused from engine to engine.)
    """
    import cudnn_attn as ca
    from cudnn_attn import neighborhood

    batch, heads, dim, tokens = q.shape[0], q.shape[-2], q.shape[-1], math.prod(spatial)
    heads_first = [t.reshape(batch, tokens, heads, dim).transpose(1, 2).contiguous() for t in (q, k, v)]

    def ours():
        # Always the fused kernels (forced); what auto would pick goes in the row (auto_pick).
        flat = [t.reshape(batch, tokens, heads, dim) for t in (q, k, v)]
        verdict = ca.explain(*flat, mask=ca.Neighborhood(spatial, kernel), layout="bshd",
                             backend=OURS_BACKEND)
        if verdict.selected != OURS_BACKEND:
            raise RuntimeError(f"{OURS_BACKEND} cannot run it: {verdict.get(OURS_BACKEND)}")
        na = getattr(neighborhood, f"na{rank}d")
        leaves = _leaves((q, k, v))

        def run(leaves=leaves):
            with ca.use_backend(OURS_BACKEND):
                return na(*leaves, kernel)
        return leaves, run

    def ours_wgmma():
        # The same call with the opt-in Hopper kernels (fused_build.hopper: the forwards, dQ and
        # dK/dV on wgmma), forward and backward. Only where they run (sm_90, fp16/bf16, head
        # dim 64/128), else an error entry.
        from cudnn_attn.fallback_kernels import fused_build

        capability = torch.cuda.get_device_capability(q.device)
        if not (capability == (9, 0) and q.dtype != torch.float32
                and dim in fused_build.HOPPER_HEAD_DIMS):
            raise RuntimeError(f"the wgmma kernels run on sm_90 fp16/bf16 at head dims "
                               f"{fused_build.HOPPER_HEAD_DIMS}, not sm_{capability[0]}{capability[1]} "
                               f"{q.dtype} D={dim}")
        from cudnn_attn.fallback_kernels import fused

        if not fused._wgmma_layouts_read_right(q.device.index or 0):  # else mma.sync would run
            raise RuntimeError("the wgmma layout probe is not exact on this device (see "
                               "test_wgmma_layouts): the fused kernels keep mma.sync")
        return (*ours(), lambda: mock.patch.dict(os.environ, {fused_build.HOPPER_ENV: "1"}))

    def ours_boxes(wide):
        # The same call with the tile rule's choice replaced, forward and backward: every
        # kernel on its 64-slot boxes (ours-64), or on the wide kernels' boxes where the device
        # runs them (ours-wide; dK/dV's only up to head dim 64). What a refit of the tile model
        # needs (benchmarks/fit_tile_model.py): both kernels measured on every problem.
        from cudnn_attn.fallback_kernels import tile_model

        chosen = ((tile_model.wide_tiles, tile_model.wide_key_tiles) if wide
                  else (tile_model.choose_tiles, tile_model.choose_tiles))
        return (*ours(), lambda: mock.patch.multiple(tile_model, forward_tiles=chosen[0],
                                                     dkdv_tiles=chosen[1]))

    def flex():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # Built eagerly: create_block_mask(_compile=True) compiles a graph of its own, which
        # cost more than these sizes' whole time share; the eager mask is the same blocks.
        block_mask = create_block_mask(natten_mask_mod(spatial, kernel), None, None, tokens,
                                       tokens, device=q.device)
        compiled = torch.compile(flex_attention, dynamic=False)
        leaves = _leaves(heads_first)
        return leaves, lambda leaves=leaves: compiled(*leaves, block_mask=block_mask)

    def natten_flex():
        import natten

        warnings.filterwarnings("ignore", module=r"torch\.nn\.attention\.flex_attention")
        if hasattr(natten, "allow_flex_compile"):
            natten.allow_flex_compile(True, backprop=True)
        nat = getattr(natten, f"na{rank}d")
        leaves = _leaves((q, k, v))
        return leaves, lambda leaves=leaves: nat(*leaves, kernel, backend="flex-fna",
                                                 torch_compile=True)

    def dense_sdpa(backend):
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        leaves = _leaves(heads_first)

        def dense(leaves=leaves, backend=backend):
            with sdpa_kernel(backend):
                return sdpa(*leaves)
        return leaves, dense

    from torch.nn.attention import SDPBackend

    return {"ours": ours, "ours-wgmma": ours_wgmma, "ours-64": lambda: ours_boxes(False),
            "ours-wide": lambda: ours_boxes(True),
            "sdpa-cudnn": lambda: dense_sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa-flash": lambda: dense_sdpa(SDPBackend.FLASH_ATTENTION),
            "flex": flex, "natten-flex": natten_flex}


def measure(engine, rows, outputs, out, leaves, forward, args, work) -> None:
    """Times ``engine``'s forward and backward into ``rows`` (``<engine>_ms``, ``_tflops`` from
    ``work(direction)`` FLOPs; a failure is an error entry) and keeps its output."""
    try:
        outputs[engine] = out.detach()
        ms = timed(forward, args)
        rows["fwd"][f"{engine}_ms"], rows["fwd"][f"{engine}_tflops"] = ms, work("fwd") / ms / 1e9
    except Exception as exc:  # noqa: BLE001
        rows["fwd"]["errors"][engine] = rows["bwd"]["errors"][engine] = _error(exc)
        return
    try:
        dout = torch.randn_like(out)

        def backward(out=out, leaves=leaves, dout=dout):
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

        ms = timed(backward, args)
        rows["bwd"][f"{engine}_ms"], rows["bwd"][f"{engine}_tflops"] = ms, work("bwd") / ms / 1e9
    except Exception as exc:  # noqa: BLE001
        rows["bwd"]["errors"][engine] = _error(exc)


def bench_problem(rank, dtype_name, dim, args, on_rows=None, problem=None):
    """One row per direction for problem ``rank`` (``PROBLEMS``, H = HIDDEN / dim) or for
    ``problem`` = (spatial, kernel, heads), in ``dtype_name`` with head dim ``dim``;
    ``on_rows(rows)`` after each engine (the caller saves them: no peer can lose ours)."""
    spatial, kernel, heads = problem or (*PROBLEMS[rank], HIDDEN // dim)
    batch, tokens = 1, math.prod(spatial)
    dtype = DTYPES[dtype_name]
    q, k, v = (torch.randn(batch, *spatial, heads, dim, device=DEVICE, dtype=dtype)
               for _ in range(3))
    name = f"{rank}-D {'x'.join(map(str, spatial))} k={'x'.join(map(str, kernel))}"
    rows = {d: {"problem": name, "rank": rank, "spatial": list(spatial), "kernel": list(kernel),
                "dtype": dtype_name, "D": dim, "H": heads, "B": batch, "dir": d, "errors": {}}
            for d in ("fwd", "bwd")}
    try:  # the tile model's figures and auto's choice, beside the measurements
        from cudnn_attn.core import roofline
        import cudnn_attn as ca

        capability = roofline.capability_for(DEVICE)
        figures = model_rows(spatial, kernel, batch, heads, dim, dtype,
                             roofline.ceilings_for(DEVICE), capability)
        flat = q.reshape(batch, tokens, heads, dim)
        auto = ca.explain(flat, flat, flat, mask=ca.Neighborhood(spatial, kernel), layout="bshd")
        for d, row in rows.items():
            row.update(figures[d], auto_pick=auto.selected, auto_why=auto.why,
                       capability=list(capability))
    except Exception as exc:  # noqa: BLE001 - a model failure must not cost the measurements
        for row in rows.values():
            row["errors"]["model"] = _error(exc)
    outputs = {}
    for engine, setup in engines(rank, spatial, kernel, q, k, v).items():
        limit = time_limit(args.peer_timeout, engine) if engine in PEERS else \
            contextlib.nullcontext()
        try:
            with limit:  # a compiled peer's setup and first call (its compile) are bounded
                leaves, forward, *scope = setup()
                scope = scope[0] if scope else contextlib.nullcontext
                with scope():
                    out = forward()
        except Exception as exc:  # noqa: BLE001 - a peer failure is a result, not a crash
            for row in rows.values():
                row["errors"][engine] = _error(exc)
            if on_rows is not None:
                on_rows(list(rows.values()))
            continue
        def work(direction, dense=engine.startswith("sdpa")):
            return (dense_flops(batch, heads, tokens, dim, direction) if dense
                    else na_flops(batch, heads, spatial, kernel, dim, direction))

        with scope():
            measure(engine, rows, outputs, out, leaves, forward, args, work)
        del out
        if on_rows is not None:
            on_rows(list(rows.values()))
    if "ours" in outputs and "flex" in outputs:  # a speed figure is only worth a right answer
        flex_out = outputs["flex"].transpose(1, 2).reshape(outputs["ours"].shape)
        rows["fwd"]["max|ours-flex|"] = (outputs["ours"].float() - flex_out.float()).abs().max().item()
    for variant, column in VARIANT_COLUMNS.items():  # each of ours' variants against ours
        if "ours" in outputs and variant in outputs:
            rows["fwd"][column] = (outputs[variant].float()
                                   - outputs["ours"].float()).abs().max().item()
    for row in rows.values():
        if row.get("ours_ms") and row.get("flex_ms"):
            row["ours/flex"] = row["flex_ms"] / row["ours_ms"]  # speedup over Flex
        if row.get("ours_ms") and row.get("ours-wgmma_ms"):
            row["wgmma/ours"] = row["ours_ms"] / row["ours-wgmma_ms"]  # speedup of the wgmma path
        add_model_ratios(row)
    del q, k, v, outputs
    torch.cuda.empty_cache()
    return list(rows.values())


def target_verdict(rows):
    """``(met, text)`` for the issue's target row (None when it was not measured)."""
    row = next((r for r in rows if r["rank"] == 2 and r["dtype"] == "bf16" and r["D"] == 128
                and r["dir"] == "fwd"), None)
    if row is None or row.get("ours_tflops") is None:
        reason = "not run" if row is None else row["errors"].get("ours", "ours did not run")
        return None, f"target NOT MEASURED (bf16, D=128, 2-D 128x128 k=31x31 forward): {reason}"
    tflops, speedup = row["ours_tflops"], row.get("ours/flex")
    met = tflops >= TARGET_TFLOPS and speedup is not None and speedup >= TARGET_VS_FLEX
    flex = "Flex did not run" if speedup is None else f"{speedup:.2f}x Flex"
    return met, (f"target {'MET' if met else 'MISSED'} (bf16, D=128, 2-D 128x128 k=31x31 forward): "
                 f"{tflops:.1f} TFLOP/s (>= {TARGET_TFLOPS}), {flex} (>= {TARGET_VS_FLEX}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="*", choices=(1, 2, 3), default=[1, 2, 3],
                        help="problem ranks (default 1 2 3)")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="the target row only: 2-D, bf16, D=128, 3 repeats")
    parser.add_argument("--no-json", action="store_true", help="print only, write no results file")
    parser.add_argument("--no-ceilings", action="store_true",
                        help="skip measuring the copy and matmul ceilings")
    parser.add_argument("--results-dir", type=Path, default=_report.RESULTS_DIR,
                        help="where the JSON goes (default benchmarks/results)")
    parser.add_argument("--peer-timeout", type=float, default=PEER_SETUP_S,
                        help="seconds a compiled peer (flex, natten-flex) may take to set up, "
                             f"compile and make its first call (default {PEER_SETUP_S:.0f})")
    parser.add_argument("--issue-rows", action="store_true",
                        help="also measure issue 34's problems that --dims does not (2-D "
                             "128x128 k7 H8 D128, 64x64 k13 H16 D64; bf16); --dims may be empty")
    parser.add_argument("--model-only", action="store_true",
                        help="print the tile model for issue 34's problems (no GPU) and exit")
    parser.add_argument("--model-ceilings", default="H200",
                        choices=("H100", "H200", "A100", "B200"),
                        help="the GPU whose ceilings --model-only uses (default H200)")
    args = parser.parse_args()
    if args.model_only:
        return print_model_only(args.model_ceilings)
    if not torch.cuda.is_available():
        print("benchmarks/neighborhood.py needs a CUDA GPU; torch sees none here. "
              "Nothing was run or written.")
        return 0
    if args.quick:
        args.dims, args.dtypes, args.head_dims, args.repeats, args.warmup = [2], ["bf16"], [128], 3, 2
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    machine = None if args.no_ceilings else ceilings.measure()
    print(ceilings.describe(machine) + "\n")

    rows: list = []

    def save(current=()):
        """The JSON with every row so far (rewritten whole after each engine)."""
        if args.no_json:
            return None
        done = rows + list(current)
        met, text = target_verdict(done)
        return _report.write_json("neighborhood", {
            "options": vars(args), "device": torch.cuda.get_device_name(), "ceilings": machine,
            "problems": {str(r): {"spatial": s, "kernel": k} for r, (s, k) in PROBLEMS.items()},
            "hidden": HIDDEN, "engines": ENGINES, "rows": done,
            "target": {"tflops >=": TARGET_TFLOPS, "vs flex >=": TARGET_VS_FLEX, "met": met,
                       "text": text}}, results_dir=args.results_dir)

    if args.issue_rows:  # issue 34's problems PROBLEMS lacks (their own heads and head dims)
        for spatial, kernel, heads, dim, _, _ in issue_only_problems():
            rows += bench_problem(len(spatial), "bf16", dim, args, on_rows=save,
                                  problem=(spatial, kernel, heads))
    for rank in args.dims:
        for dtype_name in args.dtypes:
            for dim in args.head_dims:
                rows += bench_problem(rank, dtype_name, dim, args, on_rows=save)
    ceilings.add_fraction(rows, machine)
    columns = ["problem", "dtype", "D", "dir", "ours_ms", "ours_tflops", "ours-wgmma_tflops",
               "wgmma/ours", "flex_tflops",
               "natten-flex_tflops", "sdpa-cudnn_ms", "sdpa-flash_ms", "ours/flex", "ours/ceiling",
               "max|ours-flex|"]
    _report.print_table(rows, columns)
    print("\ntile model beside the rows (benchmarks/neighborhood.py --model-only: the issue's "
          "problems):")
    _report.print_table(rows, ["problem", "dtype", "D", "dir", *MODEL_COLUMNS, "ours/model",
                               "sdpa-cudnn/model", "auto_pick"])
    print("TFLOP/s: useful (neighborhood) FLOPs for ours/flex/natten-flex; sdpa-* run dense "
          "attention on the same tokens (compare by ms)")
    errors = sorted({(engine, msg) for row in rows for engine, msg in row["errors"].items()})
    for engine, msg in errors:
        print(f"  {engine}: {msg}")
    met, text = target_verdict(rows)
    print(f"\n{text}")
    path = save()
    if path is not None:
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
