"""Paged-KV decode serving on the CPU (torch engine): ``examples/inference_server.py --mode decode``
and its ``decode_service``, checked against float64 attention computed here from the page pool,
and ``cudnn-attn cache warm --decode``'s arguments (the warm itself needs a GPU:
``test_serving_gpu.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from common import load_script
from test_cli_errors import assert_one_line_usage_error, run_main

import cudnn_attn as ca
from cudnn_attn.cli.specs import decode_inputs, parse_decode

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inference_server.py"


@pytest.fixture(scope="module")
def server():
    return load_script(EXAMPLE, "inference_server_decode")


@pytest.fixture(autouse=True)
def one_thread_and_private_key(tmp_path_factory, monkeypatch):
    """Tiny tensors: one intra-op thread is as fast and does not fight other jobs; graph cache
    files (``--graph-cache``) verify with a throwaway key."""
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE",
                       str(tmp_path_factory.mktemp("config") / "graph-cache.key"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = ["--mode", "decode", "--requests", "7", "--concurrency", "3", "--batch", "3",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--page-size", "5",
        "--max-blocks", "4", "--max-new-tokens", "6", "--check", "--seed", "1"]


def shape(server, **kw):
    sizes = dict(batch=3, heads=4, kv_heads=2, head_dim=16, page_size=5, max_blocks=4,
                 num_blocks=12, dtype=torch.float32, device="cpu")
    return server.DecodeShape(**{**sizes, **kw})


def test_decode_report(server, capsys):
    assert server.main(TINY + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    args = server.parse_args(TINY)
    requests = server.decode_requests(args, 5 * 4)
    assert report["mode"] == "decode" and report["requests"] == 7 and report["at_load"] is None
    assert report["engine"] == "torch" and report["backends"] == ["torch"]
    assert set(report["declined"]) == {"cudnn", "cupy"}  # auto tried them first, on the CPU
    assert report["shape"] == {"batch": 3, "heads": 4, "kv_heads": 2, "head_dim": 16,
                               "page_size": 5, "max_blocks": 4, "num_blocks": 12}
    # every generated token was decoded once and checked against the dense float64 oracle
    assert report["tokens"] == report["compared_tokens"] == sum(r["new_tokens"] for r in requests)
    assert report["mismatches"] == 0 and 0 < report["max_err"] < 1e-5
    assert report["steps"] >= max(r["new_tokens"] for r in requests)
    # one call signature for every step: fixed batch, pool and capacity
    assert report["call_signatures"] == 1
    assert report["hit_rate"] == pytest.approx((report["steps"] - 1) / report["steps"])
    assert report["hit_rate_source"] == "call signatures"
    assert report["graphs_built"] == 0 and report["graph_cache"]["builds"] == 0
    assert "no cuDNN graphs" in report["graphs_note"]
    assert 0 < report["step_p50_ms"] <= report["step_p99_ms"]
    assert 0 < report["p50_ms"] <= report["p99_ms"] and report["tokens_per_s"] > 0
    assert math.isfinite(report["checksum"])


def test_human_decode_report_and_graph_cache_option(server, capsys, tmp_path):
    empty = tmp_path / "graphs"
    empty.mkdir(mode=0o700)
    assert server.main(TINY + ["--requests", "2", "--graph-cache", str(empty)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"graph cache {empty}: 0 file(s) loaded, 0 rejected, 0 graphs built")
    assert "2 requests decoded on cpu (float32), engine torch" in out
    for part in ("tokens/s", "step p50", "p99", "graphs built while serving 0", "hit rate",
                 "0 mismatches"):
        assert part in out


def test_dense_mode_is_the_default(server, capsys):
    argv = ["--requests", "2", "--max-batch", "2", "--min-seq", "8", "--max-seq", "16",
            "--heads", "2", "--head-dim", "8", "--json"]
    assert server.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "dense" and report["requests"] == 2 and report["at_load"] is None


def pool_oracle(service, q, b: int, n: int) -> torch.Tensor:
    """Float64 attention of ``q[b]`` ``[H, D]`` over sequence ``b``'s first ``n`` tokens, read
    from the page pool through the host block table (independent of the service's mirror)."""
    P, cache = service.shape.page_size, service.cache
    pages = [int(p) for p in cache.block_table[b].tolist()]
    k = torch.stack([cache.k[pages[t // P], t % P] for t in range(n)]).double()  # [n, Hkv, D]
    v = torch.stack([cache.v[pages[t // P], t % P] for t in range(n)]).double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("hd,nhd->hn", q[b].double(), k) * q.shape[-1] ** -0.5
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v)


def test_steps_match_attention_over_the_pages(server):
    service = server.DecodeService(shape(server), check=True, seed=4)
    seqs = [service.submit(n, m, seed=i) for i, (n, m) in enumerate([(7, 5), (1, 9), (12, 3)])]
    assert service.admit() == 3
    assert [s.slot for s in seqs] == [0, 1, 2]
    worst = 0.0
    for _ in range(9):
        lens = [int(n) for n in service.lens]
        q = (service.hidden @ service.w_qkv).view(3, 8, 16)[:, :4]
        out = service.step()
        service.compare()
        for b, seq in enumerate(service.slots):
            if seq is not None:
                ref = pool_oracle(service, q, b, lens[b] + 1)
                worst = max(worst, (out[b, 0].double() - ref).abs().max().item())
        service.retire()
    assert 0 < worst < 1e-5
    assert all(s.done.is_set() for s in seqs) and not any(service.slots)
    assert [s.reply["new_tokens"] for s in seqs] == [5, 9, 3]
    stats = service.stats()
    assert stats["compared_tokens"] == 17 and stats["mismatches"] == 0
    # every page went back to the pool (all but the scratch page)
    assert len(service.cache.free) == 11 and (service.cache.block_table < 0).all()


def test_check_catches_a_wrong_page(server):
    service = server.DecodeService(shape(server), check=True, seed=5)
    service.submit(9, 4)
    service.admit()
    service.step()
    service.compare()
    assert int(service.mismatches) == 0
    # point the sequence's first page at its second: attention reads the wrong keys
    service.table[0, 0] = service.table[0, 1]
    service.step()
    service.compare()
    assert int(service.mismatches) == 1 and float(service.max_err) > 1e-3


def test_slots_wait_for_pages_and_are_reused(server):
    # 3 slots but a pool of 5 pages (1 scratch): two 8-token sequences (2 pages each) fit, a
    # third waits until one finishes, and then reuses a slot.
    service = server.DecodeService(shape(server, num_blocks=5), check=True, seed=6)
    seqs = [service.submit(4, 4, seed=i) for i in range(3)]
    assert service.admit() == 2 and seqs[2].slot is None
    for _ in range(4):
        service.step()
        service.compare()
        service.retire()
    assert seqs[0].done.is_set() and seqs[1].done.is_set()
    assert service.admit() == 1 and seqs[2].slot == 0
    for _ in range(4):
        service.step()
        service.compare()
        service.retire()
    assert seqs[2].done.is_set() and service.stats()["mismatches"] == 0


def test_bad_requests_and_shapes_are_refused(server):
    service = server.DecodeService(shape(server), seed=0)
    for prompt, new in ((0, 3), (3, 0), (15, 6)):  # a slot holds 20 tokens
        with pytest.raises(ValueError):
            service.submit(prompt, new)
    with pytest.raises(ValueError, match="num_blocks"):
        server.DecodeService(shape(server, num_blocks=4))
    with pytest.raises(SystemExit):
        server.parse_args(["--mode", "decode", "--max-blocks", "4", "--num-blocks", "4"])


# --------------------------------------------------------------------------------------------
# cudnn-attn cache warm --decode
# --------------------------------------------------------------------------------------------

DECODE = ["cache", "warm", "--decode", "4,8,2,64", "--page-size", "16", "--max-blocks", "8"]
BAD_WARM = [
    (["cache", "warm"], "nothing to warm: give a config"),
    (["cache", "warm", "--page-size", "16"], "--page-size: options of a --decode call"),
    (["cache", "warm", "--decode", "4,8,2"], "four positive ints B,H_Q,H_KV,D"),
    (["cache", "warm", "--decode", "4,8,0,64"], "four positive ints"),
    (["cache", "warm", "--decode", "4,8,3,64", "--page-size", "16", "--max-blocks", "8"],
     "must be a multiple of H_KV"),
    (["cache", "warm", "--decode", "4,8,2,64"], "needs --page-size and --max-blocks"),
    (DECODE[:-2] + ["--max-blocks", "0"], "positive integer"),
    (DECODE + ["--seq-q", "200"], "exceeds a sequence's capacity"),
    (DECODE + ["--dtype", "int8"], "--dtype must be one of"),
    (DECODE + ["--mask", "padding:1,2,3,4"], "--mask for --decode"),
    (DECODE + ["--mask", "diagonal"], "--mask for --decode"),
    (DECODE + ["--backend", "torch"], "nothing to warm"),
    (DECODE + ["--device", "cpu"], "needs a CUDA device; got --device cpu"),
]


@pytest.mark.parametrize("argv, match", BAD_WARM, ids=lambda x: " ".join(x) if isinstance(x, list)
                         else None)
def test_cache_warm_decode_arguments(capsys, argv, match):
    assert_one_line_usage_error(*run_main(capsys, argv), match)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cache_warm_decode_refuses_without_a_gpu(capsys, tmp_path):
    code, out, err = run_main(capsys, DECODE + ["--save", str(tmp_path / "g")])
    assert_one_line_usage_error(code, out, err, "no CUDA device is available to torch")
    assert not (tmp_path / "g").exists()


def test_decode_spec_defaults_and_the_warm_call_is_valid():
    spec = parse_decode("3,4,2,16", page_size=5, max_blocks=4, num_blocks=None, seq_q=1,
                        dtype="fp32", mask="causal:bottom_right")
    assert (spec.num_blocks, spec.dtype, spec.mask) == (12, "float32", ca.Causal("bottom_right"))
    (q, k, v, lens), kwargs = decode_inputs(spec, "cpu")
    assert q.shape == (3, 1, 4, 16) and q.is_contiguous() and k.shape == v.shape == (12, 5, 2, 16)
    assert lens.dtype == kwargs["block_table"].dtype == torch.int32
    assert kwargs["block_table"].shape == (3, 4) and int(kwargs["block_table"].max()) < 12
    # the call the GPU warm makes is a valid call (here on the torch engine): zeros in, zeros out
    out = ca.attention_with_kvcache(q, k, v, lens, **kwargs, backend="torch")
    assert out.shape == (3, 1, 4, 16) and not out.any()
