"""benchmarks/cudnn.py's issue-35 additions (verdicts, kernel comparison, FLOP counts) and
benchmarks/cudnn_host.py (host microseconds on the CPU), on this CPU.

cudnn.py's measurements need a GPU; its pure parts are checked here with rows written the way
``bench_shape`` / ``bench_tiny_causal`` write them. cudnn_host.py runs here for real (a few calls
per case, in a subprocess: it installs its stand-in process-wide).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from common import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports its siblings _report, ceilings, fp8_rows
    try:
        return load_script(BENCH / "cudnn.py", "bench_cudnn_issue35")
    finally:
        if str(BENCH) in sys.path:
            sys.path.remove(str(BENCH))


def test_forward_backward_flops_are_the_sum_of_both(bench):
    fwd = bench.flops(2, 16, 1024, 128, True, "fwd")
    assert fwd == 4.0 * 2 * 16 * 1024 * 1024 * 128 / 2
    assert bench.flops(2, 16, 1024, 128, True, "fwd+bwd") == fwd + bench.flops(
        2, 16, 1024, 128, True, "bwd")


def test_kernels_only_ours_launches_are_counted_by_name(bench):
    ours = ["sdpa_fprop", "fill", "sdpa_bprop", "fill", "copy"]
    torch_cudnn = ["fill", "sdpa_fprop", "sdpa_bprop"]
    assert bench.call_costs.only_in(ours, torch_cudnn) == ["fill", "copy"]
    assert bench.call_costs.only_in(torch_cudnn, ours) == []


def _row(bench, direction, ours_ms, torch_ms, ours_latency, torch_latency):
    work = bench.flops(16, 16, 1024, 128, False, direction)
    return {"dtype": "bfloat16", "D": 128, "S": 1024, "B": 16, "H": 16, "causal": False,
            "dir": direction, "ours_ms": ours_ms, "bare_ms": ours_ms,
            "ours_tflops": work / ours_ms / 1e9, "bare_tflops": work / ours_ms / 1e9,
            "ours/bare": 1.0, "torch-cudnn_ms": torch_ms,
            "torch-cudnn_tflops": work / torch_ms / 1e9,
            "ours/torch-cudnn": torch_ms / ours_ms,
            "ours/torch-cudnn latency": torch_latency / ours_latency}


def test_verdicts_judge_latency_and_the_tiny_calls_host_time(bench):
    rows = [_row(bench, "fwd", 0.285, 0.268, 0.300, 0.310),
            _row(bench, "fwd+bwd", 1.544, 1.297, 1.60, 1.40)]
    overhead = [{"call": "tiny causal: ours", "us_per_call": 41.7,
                 "vs_torch_cudnn": 41.7 / 37.9},
                {"call": "tiny causal: torch-cudnn", "us_per_call": 37.9, "vs_torch_cudnn": 1.0}]
    verdicts = bench.target_verdicts(rows, overhead)
    host = next(v for k, v in verdicts.items() if k.startswith("tiny causal call host time"))
    assert host == {"value": pytest.approx(41.7 / 37.9), "met": False}
    latency = next(v for k, v in verdicts.items() if "latency" in k)
    assert latency == {"value": pytest.approx(1.40 / 1.60), "met": False}
    throughput = next(v for k, v in verdicts.items()
                      if k.startswith("ours/torch-cudnn >=") and "latency" not in k)
    assert throughput["value"] == pytest.approx(1.297 / 1.544) and throughput["met"] is False
    padded = next(v for k, v in verdicts.items() if k.startswith("tiny padded call"))
    assert padded == {"value": None, "met": None}  # not measured: no verdict
    fast = [_row(bench, "fwd", 0.25, 0.268, 0.29, 0.31)]
    verdicts = bench.target_verdicts(fast, [{"call": "tiny causal: ours", "us_per_call": 36.0,
                                             "vs_torch_cudnn": 36.0 / 37.9},
                                            {"call": "tiny padded (device lengths): ours",
                                             "us_per_call": 40.0, "vs_torch_cudnn": 0.9}])
    assert all(v["met"] for k, v in verdicts.items()
               if "latency" in k or k.startswith(("tiny causal", "tiny padded",
                                                  "ours/torch-cudnn")))


def test_host_benchmark_runs_on_the_cpu_and_writes_its_rows(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "cudnn_host.py"), "--calls", "20",
                           "--repeats", "1", "--json-to", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("cudnn_host-*.json")
    rows = {r["call"]: r for r in json.loads(path.read_text())["rows"]}
    for case in ("fwd", "fwd (grad)", "fwd+bwd", "padding", "padding-rt", "dropout", "bias",
                 "kvcache decode", "paged decode", "varlen", "flash_attn_func fwd+bwd",
                 "flash_attn_varlen_func fwd+bwd", "flash_attn_with_kvcache decode",
                 "new shape"):
        assert rows[f"ours {case}"]["us_per_call"] > 0
        assert rows[f"ours {case}"]["vs_torch"] > 0
        assert isinstance(rows[f"ours {case}"]["kernels"], int)
    # The plain calls launch nothing besides cuDNN's graph; a padded one clears its empty rows.
    assert rows["ours fwd"]["kernels"] == rows["ours fwd (grad)"]["kernels"] == 0
    assert rows["ours padding"]["kernels"] > 0
    assert rows["ours flash_attn_func fwd+bwd"]["vs_torch"] == pytest.approx(
        rows["ours flash_attn_func fwd+bwd"]["us_per_call"]
        / rows["torch sdpa fwd+bwd"]["us_per_call"])
    for kind in ("fwd", "padding", "dropout", "bias"):  # each of ours against its own kind
        assert rows[f"torch sdpa {kind}"]["us_per_call"] > 0
    assert rows["ours paged decode"]["vs_torch"] == pytest.approx(  # a padded call, to torch
        rows["ours paged decode"]["us_per_call"] / rows["torch sdpa padding"]["us_per_call"])
    assert rows["ours new shape"]["vs_torch"] == pytest.approx(  # a plain forward, to torch
        rows["ours new shape"]["us_per_call"] / rows["torch sdpa fwd"]["us_per_call"])
    assert rows["ours padding-rt"]["vs_torch"] == pytest.approx(
        rows["ours padding-rt"]["us_per_call"] / rows["torch sdpa padding"]["us_per_call"])
    if importlib.util.find_spec("cudnn") is not None:  # the frontend's dispatch, and ours
        for launch in ("pygraph.execute", "ordered launch"):
            assert rows[f"frontend dispatch: {launch}"]["us_per_call"] > 0
    # The stand-in executed every call: it counts them.
    assert "executed" in done.stdout


def test_varlen_rows_calls_run_on_the_stand_in_and_rows_pair_each_direction(monkeypatch):
    """benchmarks/varlen_rows.py's calls (the GPU's tiny packed rows) run here on the fake
    cuDNN engine, ours on its ragged graphs: the packed forward against the float64 oracle of
    each sequence, the FlashAttention function's gradients finite; torch's padded calls run or
    are declined with a RuntimeError (what ``_host_us`` leaves out). ``rows`` pairs each of ours
    with torch's padded call of its direction, cuDNN's first."""
    import cudnn_fake
    import torch
    from test_varlen import oracle_varlen

    from cudnn_attn.model import masks
    from cudnn_attn.packed import calls as packed_calls

    if not cudnn_fake.frontend_present():
        pytest.skip("nvidia-cudnn-frontend is not installed")
    varlen_rows = load_script(BENCH / "varlen_rows.py", "bench_varlen_rows")
    monkeypatch.setattr(masks, "_runtime_lengths", lambda value: isinstance(value, torch.Tensor))
    monkeypatch.setattr(packed_calls, "on_accelerator", lambda t: isinstance(t, torch.Tensor))
    state = cudnn_fake.install(monkeypatch)
    found = varlen_rows.calls("cpu", torch.float16)
    out = cudnn_fake.host(found["tiny varlen fwd: ours"]())
    assert state[1] and all(spec.ragged for spec, _ in state[1]), "not the ragged graph"
    lens = list(varlen_rows.LENGTHS)
    g = torch.Generator().manual_seed(0)  # the calls' q, k, v: the same draws
    q, k, v = (torch.randn(sum(lens), varlen_rows.HEADS, varlen_rows.DIM, dtype=torch.float16,
                           generator=g).to(torch.float64) for _ in range(3))
    ref, _ = oracle_varlen(q, k, v, lens, lens, causal="top_left")
    torch.testing.assert_close(out.to(torch.float64), ref, atol=2e-3, rtol=2e-3)
    grads = found["tiny varlen fwd+bwd: flash_attn_varlen_func"]()
    assert len(grads) == 3 and all(torch.isfinite(cudnn_fake.host(t)).all() for t in grads)
    for label, call in found.items():
        if "torch-" in label:
            try:
                call()
            except RuntimeError:
                pass  # that backend declines here
    rows = {r["call"]: r for r in varlen_rows.rows({
        "tiny varlen fwd: ours": 30.0, "tiny varlen fwd: torch-cudnn": 20.0,
        "tiny varlen fwd: torch-efficient": 10.0,
        "tiny varlen fwd+bwd: flash_attn_varlen_func": 90.0,
        "tiny varlen fwd+bwd: torch-efficient": 60.0})}
    assert rows["tiny varlen fwd: ours"]["vs_torch_cudnn"] == pytest.approx(1.5)
    assert rows["tiny varlen fwd+bwd: flash_attn_varlen_func"]["vs_torch_cudnn"] == \
        pytest.approx(1.5)


def test_a_call_timeline_splits_latency_into_host_wait_kernels_and_gaps(bench):
    summarize_timeline = bench.call_costs.summarize_timeline
    # two calls; the first launches kernels at 30-50 and 45-70 (overlapping) and 90-100; the
    # second's only kernel starts after its host range ended
    calls = [(200.0, 220.0), (0.0, 40.0)]
    kernels = [(90.0, 100.0, "c"), (30.0, 50.0, "a"), (45.0, 70.0, "b"), (230.0, 260.0, "d")]
    got = summarize_timeline(calls, kernels)
    first = {"host_us": 40.0, "first_kernel_us": 30.0, "busy_us": 50.0, "idle_us": 20.0,
             "latency_us": 100.0}
    second = {"host_us": 20.0, "first_kernel_us": 30.0, "busy_us": 30.0, "idle_us": 0.0,
              "latency_us": 60.0}
    for key in first:  # the median of two is the larger one
        assert got[key] == max(first[key], second[key]), key
    assert got["kernels"] == ["a", "b", "c"] and got["calls"] == 2
    # no kernel at all: the host's range is the latency, the device fields are unknown
    idle = summarize_timeline([(0.0, 5.0)], [])
    assert idle["latency_us"] == 5.0 and idle["first_kernel_us"] is None
    assert idle["idle_us"] is None and idle["kernels"] == []
