"""benchmarks/neighborhood.py on CPU: it exits cleanly without CUDA, and the block mask it gives
FlexAttention (its main peer) is NATTEN's rule, checked against tests/oracle.py."""

import datetime
import os
import subprocess
import sys
from pathlib import Path

import oracle
import pytest
import torch
from common import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "neighborhood.py"


def _load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports its sibling _report
    try:
        module = load_script(SCRIPT, "bench_neighborhood")
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_quick_run_without_cuda_exits_zero_and_writes_nothing():
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    result = ROOT / "benchmarks" / "results" / f"neighborhood-{day}.json"
    before = result.stat().st_mtime_ns if result.exists() else None
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout and "Nothing was run or written" in done.stdout
    after = result.stat().st_mtime_ns if result.exists() else None
    assert after == before


@pytest.mark.parametrize("spatial, kernel, dilation, causal", [
    ((17,), (5,), (3,), (False,)),
    ((16,), (4,), (2,), (True,)),
    ((7, 9), (3, 4), (2, 1), (False, True)),
    ((5, 4, 6), (3, 2, 3), (1, 2, 2), (True, False, False)),
])
def test_flex_mask_mod_is_the_natten_rule(spatial, kernel, dilation, causal):
    bench = _load_script()
    n = 1
    for length in spatial:
        n *= length
    idx = torch.arange(n)
    got = bench.natten_mask_mod(spatial, kernel, dilation, causal)(0, 0, idx[:, None], idx[None, :])
    want = oracle.build_visibility(1, n, n, neighborhood=dict(
        spatial_shape=spatial, kernel_size=kernel, dilation=dilation, is_causal=causal))[0]
    assert torch.equal(got, want)


def test_flops_and_target_verdict():
    bench = _load_script()
    assert bench.na_flops(1, 16, (128, 128), (31, 31), 128, "fwd") == 4.0 * 16 * 128 * 128 * 961 * 128
    assert bench.na_flops(2, 1, (8,), (3,), 4, "bwd") == 2.5 * 4 * 2 * 8 * 3 * 4
    row = {"rank": 2, "dtype": "bf16", "D": 128, "dir": "fwd", "errors": {}}
    assert bench.target_verdict([{**row, "ours_tflops": 300.0, "ours/flex": 1.6}])[0] is True
    assert bench.target_verdict([{**row, "ours_tflops": 300.0, "ours/flex": 1.4}])[0] is False
    assert bench.target_verdict([{**row, "ours_tflops": 240.0, "ours/flex": 2.0}])[0] is False
    met, text = bench.target_verdict([{**row, "errors": {"ours": "no cupy"}}])
    assert met is None and "no cupy" in text


def test_ours_rows_are_saved_before_a_peer_that_overruns_its_time(monkeypatch):
    """issue 23: FlexAttention's compile ate the benchmark's whole share and no row came back.
    Ours is measured and handed to ``on_rows`` (the JSON) first; a compiled peer that overruns
    ``--peer-timeout`` is recorded as timed out and the run goes on."""
    import argparse
    import copy
    import time

    bench = _load_script()
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "OURS_BACKEND", "torch")
    monkeypatch.setattr(bench, "PROBLEMS", {2: ((6, 6), (3, 3))})
    monkeypatch.setattr(bench, "HIDDEN", 32)
    monkeypatch.setattr(bench, "DTYPES", {"fp32": torch.float32})
    monkeypatch.setattr(bench, "timed", lambda fn, args: (fn(), 1.0)[1])
    slow_mask = bench.natten_mask_mod

    def stalls(*a, **kw):  # Flex's block-mask setup, as slow as a compile that never ends
        time.sleep(30)
        return slow_mask(*a, **kw)
    monkeypatch.setattr(bench, "natten_mask_mod", stalls)
    saved = []
    args = argparse.Namespace(peer_timeout=0.5, warmup=0, repeats=1)
    start = time.monotonic()
    rows = bench.bench_problem(2, "fp32", 16, args, on_rows=lambda r: saved.append(copy.deepcopy(r)))
    assert time.monotonic() - start < 20
    fwd = next(r for r in rows if r["dir"] == "fwd")
    assert fwd["ours_ms"] == 1.0 and "flex_ms" not in fwd
    # the tile model's figures and auto's pick sit beside the measurements
    assert fwd["model_pairs"] > 0 and fwd["ours/model"] == 1.0 / fwd["model_fused_ms"]
    assert fwd["auto_pick"] == "torch" and "model" not in fwd["errors"]
    assert fwd["errors"]["flex"].startswith("PeerTimeout")
    first_with_ours = next(i for i, r in enumerate(saved) if "ours_ms" in r[0])
    first_flex = next(i for i, r in enumerate(saved) if "flex" in r[0]["errors"])
    assert first_with_ours < first_flex  # ours was saved before the peer was tried


def test_model_only_prints_the_issue_problems_without_a_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--model-only"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for problem in ("2-D 128x128 k=31x31", "2-D 128x128 k=7x7", "2-D 64x64 k=13x13",
                    "1-D 32768 k=2048", "3-D 32x32x32 k=7x7x7"):
        rows = [line for line in lines if line.startswith(problem)]
        assert len(rows) == 2 and " fwd " in rows[0] and " bwd " in rows[1], (problem, rows)
    # the cost rule's pick follows the issue's measured order (ours vs dense cuDNN, forward)
    bench = _load_script()
    picks = {line.split("  ")[0].strip(): line.split()
             for line in lines if " fwd " in line}
    for spatial, kernel, heads, dim, ours, dense in bench.ISSUE_PROBLEMS:
        name = f"{len(spatial)}-D {'x'.join(map(str, spatial))} k={'x'.join(map(str, kernel))}"
        assert picks[name][-3] == ("cupy" if ours < dense else "cudnn"), picks[name]


def test_model_ratios_are_measured_over_predicted():
    bench = _load_script()
    row = {"ours_ms": 3.0, "model_fused_ms": 2.0, "sdpa-cudnn_ms": 1.0, "model_dense_ms": 4.0}
    bench.add_model_ratios(row)
    assert row["ours/model"] == 1.5 and row["sdpa-cudnn/model"] == 0.25
    row = {"model_fused_ms": 2.0}
    bench.add_model_ratios(row)
    assert "ours/model" not in row


def test_issue_rows_measure_the_problems_the_ranks_lack(monkeypatch):
    """``--issue-rows``: issue 34's 2-D k7 and 64x64 k13 problems, with their own heads and head
    dims (the ranks' problems use H = HIDDEN / D), measured by the same ``bench_problem``."""
    import argparse

    bench = _load_script()
    only = bench.issue_only_problems()
    assert [(p[0], p[1], p[2], p[3]) for p in only] == [((128, 128), (7, 7), 8, 128),
                                                      ((64, 64), (13, 13), 16, 64)]
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "OURS_BACKEND", "torch")
    monkeypatch.setattr(bench, "DTYPES", {"bf16": torch.float32})
    monkeypatch.setattr(bench, "timed", lambda fn, args: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "PEERS", ())
    monkeypatch.setattr(bench, "ENGINES", ("ours",))
    args = argparse.Namespace(peer_timeout=0.5, warmup=0, repeats=1)
    rows = bench.bench_problem(2, "bf16", 8, args, problem=((6, 7), (3, 5), 3))
    fwd = next(r for r in rows if r["dir"] == "fwd")
    assert fwd["problem"] == "2-D 6x7 k=3x5" and fwd["H"] == 3 and fwd["D"] == 8
    assert fwd["ours_ms"] == 1.0


def test_an_engines_scope_holds_its_forward_and_backward(monkeypatch):
    """ours' variants switch kernels by a context (an environment variable, the tile rule): the
    backward must be timed inside it too, not only the forward (the wgmma column once timed the
    wgmma forward with the mma.sync backward)."""
    import argparse
    import contextlib

    bench = _load_script()
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "OURS_BACKEND", "torch")
    monkeypatch.setattr(bench, "DTYPES", {"bf16": torch.float32})
    inside, seen = [], []

    @contextlib.contextmanager
    def scope():
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    def timed(fn, args):
        fn()
        seen.append(bool(inside))
        return 1.0

    def engines(rank, spatial, kernel, q, k, v):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return {"ours-64": lambda: (leaves, lambda: leaves[0] * leaves[1] * leaves[2], scope)}

    monkeypatch.setattr(bench, "timed", timed)
    monkeypatch.setattr(bench, "engines", engines)
    args = argparse.Namespace(peer_timeout=0.5, warmup=0, repeats=1)
    rows = bench.bench_problem(2, "bf16", 8, args, problem=((6, 7), (3, 5), 3))
    assert seen == [True, True]  # forward, then backward
    assert all(r["ours-64_ms"] == 1.0 for r in rows)
    assert rows[0]["spatial"] == [6, 7] and rows[0]["kernel"] == [3, 5]


def test_ours_variants_run_the_same_call(monkeypatch):
    import argparse

    bench = _load_script()
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "OURS_BACKEND", "torch")
    monkeypatch.setattr(bench, "DTYPES", {"bf16": torch.float32})
    monkeypatch.setattr(bench, "timed", lambda fn, args: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "PEERS", ())
    args = argparse.Namespace(peer_timeout=0.5, warmup=0, repeats=1)
    fwd, bwd = bench.bench_problem(2, "bf16", 8, args, problem=((6, 7), (3, 5), 3))
    for variant in ("ours-64", "ours-wide"):  # the torch engine ignores the boxes: same output
        assert fwd[f"{variant}_ms"] == bwd[f"{variant}_ms"] == 1.0
        assert fwd[bench.VARIANT_COLUMNS[variant]] == 0.0
    assert "ours-wgmma" in fwd["errors"]  # no sm_90 here: an error entry, not a crash
