"""Smoke test of examples/inference_server.py with tiny settings (loopback, a few requests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from common import load_script

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inference_server.py"


@pytest.fixture(scope="module")
def server():
    return load_script(EXAMPLE, "inference_server_example")


TINY = ["--requests", "8", "--concurrency", "3", "--max-batch", "3", "--min-seq", "16",
        "--max-seq", "64", "--heads", "2", "--head-dim", "16", "--check", "--seed", "3"]


def test_report(server, capsys):
    assert server.main(TINY + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 8
    policy_shapes = 3 * 3 * 3  # batch (1, 2, 3) x q (16, 32, 64) x kv (16, 32, 64)
    assert 1 <= report["buckets_used"] <= min(8, policy_shapes)
    assert report["buckets_used"] + report["bucket_hits"] == 8
    assert report["hit_rate"] == pytest.approx(report["bucket_hits"] / 8)
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    tolerance = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}[report["dtype"]]
    assert report["max_err"] < tolerance  # padded bucket == each request alone, on real rows
    if torch.cuda.is_available():
        assert report["backends"]
    else:
        assert report["backends"] == ["torch"] and report["device"] == "cpu"
        assert report["graphs_built"] == report["buckets_used"]


def test_human_report(server, capsys):
    assert server.main(TINY + ["--requests", "2"]) == 0  # the later --requests wins
    out = capsys.readouterr().out
    assert out.startswith("2 requests on")
    for part in ("hit rate", "graphs built", "p50", "p99", "max |padded - unpadded|"):
        assert part in out


def test_same_bucket_is_a_hit_and_bad_requests_are_refused(server):
    args = server.parse_args(TINY)
    policy = server.BucketPolicy(min_seq=16, max_seq=64, max_batch=3)
    service = server.AttentionService(policy, device="cpu", dtype=torch.float32,
                                      mask=server.ca.Causal("bottom_right"), check=True)
    first = service.handle({"heads": 2, "head_dim": 16, "seq_lens": [5, 9]})
    second = service.handle({"heads": 2, "head_dim": 16, "seq_lens": [16, 2], "seed": 1})
    third = service.handle({"heads": 2, "head_dim": 16, "seq_lens": [17]})
    assert first["bucket"] == second["bucket"] == [2, 16, 16] and third["bucket"] == [1, 32, 32]
    info = service.buckets.info()
    assert (info["hits"], info["misses"]) == (1, 2) and service.max_err < 1e-5
    for bad in ({"heads": 2, "head_dim": 16, "seq_lens": []},
                {"heads": 2, "head_dim": 16, "seq_lens": [3], "seq_lens_kv": [3, 4]},
                {"heads": 2, "head_dim": 16, "seq_lens": [65]}):
        with pytest.raises(ValueError):
            service.handle(bad)
    assert args.requests == 8
