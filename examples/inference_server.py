"""A tiny attention inference server with shape bucketing, and a bounded load generator.

The server (stdlib ``ThreadingHTTPServer`` on 127.0.0.1, an ephemeral port) answers
``POST /attention`` with JSON ``{"heads": H, "head_dim": D, "seq_lens": [S_0, S_1, ...]}``
(one entry per batch row; optional ``"seq_lens_kv"``). It makes random q/k/v for those lengths,
pads them to a bucket of a ``BucketPolicy`` (zeros + a ``Padding`` mask of the real lengths),
runs ``cudnn_attn.attention`` and answers with the bucket, the backend, the compute time and a
checksum of the real rows. With ``--check`` each answer is also compared with the unpadded call.

The load generator sends ``--requests`` requests of random batch size and lengths from
``--concurrency`` threads, then prints hit rate (lookups of an already-seen bucket, i.e. graph),
graphs built, and p50/p99 latency, and stops the server. On a GPU the cudnn backend builds one
graph per bucket through ``cudnn_attn.graph_cache`` and its counters are reported; on the CPU the
torch engine runs the same buckets and the bucket counters stand in for graphs::

    python examples/inference_server.py --requests 200 --concurrency 8
    python examples/inference_server.py --requests 6 --json   # machine-readable report

``--mode decode`` serves ``POST /generate`` (``{"prompt_len": n, "new_tokens": m}``) instead:
autoregressive decoding on a paged KV cache, ``--batch`` slots sharing one page pool, every step
one ``attention_with_kvcache(..., block_table=, mask=Causal("bottom_right"))`` call with the
lengths as a device tensor (``decode_service.py``). Batch, pool and capacity are fixed, so one
graph serves every step; the report gives graphs built while serving, the share of steps that
built none (hit rate), p50/p99 step latency and tokens/s; ``--check`` compares every step with
dense float64 attention. ``--graph-cache DIR`` loads saved graphs at start: warmed with the same
decode shape, the server builds no graph at all (a GPU test checks it)::

    cudnn-attn cache warm --decode 8,8,2,64 --page-size 16 --max-blocks 8 --save /tmp/graphs
    python examples/inference_server.py --mode decode --graph-cache /tmp/graphs --check
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

import cudnn_attn as ca
from cudnn_attn.graphs.buckets import BucketPolicy, pad_to_bucket
from cudnn_attn.graphs.cache import GraphCache, graph_cache

# The decode mode lives next to this file (and reuses paged_decode's page pool): importable
# however this example is started (as a script, or loaded by path from the tests).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_service import DecodeService, DecodeShape, percentile

COUNTERS = ("hits", "misses", "builds", "loads", "waits")


class AttentionService:
    """Runs bucketed attention requests; counts bucket hits in its own ``GraphCache``."""

    def __init__(self, policy: BucketPolicy, *, device: str, dtype: torch.dtype, mask,
                 backend: str = "auto", check: bool = False):
        self.policy, self.device, self.dtype, self.mask = policy, device, dtype, mask
        self.backend, self.check = backend, check
        # One entry per (bucket, heads, dims): what one cuDNN graph serves. Values are the
        # backend chosen for it, so the counters read as graph hits/misses on every engine.
        self.buckets = GraphCache(maxsize=policy.num_shapes)
        self.max_err = 0.0
        self._lock = threading.Lock()

    def handle(self, request: dict) -> dict:
        heads, dim = int(request["heads"]), int(request["head_dim"])
        lens_q = [int(n) for n in request["seq_lens"]]
        lens_kv = [int(n) for n in request.get("seq_lens_kv", lens_q)]
        if not lens_q or len(lens_q) != len(lens_kv) or min(lens_q + lens_kv) < 1:
            raise ValueError("seq_lens and seq_lens_kv must be equally long lists of ints >= 1")
        gen = torch.Generator().manual_seed(int(request.get("seed", 0)))

        def rnd(n: int) -> torch.Tensor:
            return torch.randn(heads, n, dim, generator=gen).to(self.device, self.dtype)

        qs, ks, vs = [rnd(n) for n in lens_q], [rnd(n) for n in lens_kv], [rnd(n) for n in lens_kv]
        start = time.perf_counter()
        padded = pad_to_bucket(self.policy, qs, ks, vs, mask=self.mask)
        key = (padded.shape, heads, dim, self.dtype, self.mask)
        backend = self.buckets.get_or_build(key, lambda: self._backend_for(padded))
        out = ca.attention(padded.q, padded.k, padded.v, mask=padded.mask, backend=self.backend)
        outs = padded.unpad(out)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if self.check:
            self._check(qs, ks, vs, outs)
        return {"bucket": list(padded.shape), "backend": backend, "compute_ms": 1e3 * elapsed,
                "checksum": float(sum(o.double().sum() for o in outs))}

    def _backend_for(self, padded) -> str:
        found = ca.explain(padded.q, padded.k, padded.v, mask=padded.mask, backend=self.backend)
        return found.selected or self.backend

    def _check(self, qs, ks, vs, outs) -> None:
        for q, k, v, o in zip(qs, ks, vs, outs):
            ref = ca.attention(q[None], k[None], v[None], mask=self.mask, backend="torch")[0]
            err = (o.double() - ref.double()).abs().max().item()
            with self._lock:
                self.max_err = max(self.max_err, err)


def make_handler(service, path: str = "/attention"):
    """An HTTP handler class answering ``POST path`` with ``service.handle(json body)``."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            try:
                if self.path != path:
                    raise LookupError(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                reply, code = service.handle(json.loads(body)), 200
            except LookupError as exc:
                reply, code = {"error": f"unknown path {exc}"}, 404
            except (ValueError, TypeError, KeyError) as exc:
                reply, code = {"error": f"{type(exc).__name__}: {exc}"}, 400
            except RuntimeError as exc:  # the decode loop failed
                reply, code = {"error": f"{type(exc).__name__}: {exc}"}, 500
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # keep the report readable
            pass

    return Handler


def serve_requests(service, path: str, requests: list[dict], args) -> tuple[list, float]:
    """Serve ``service`` on loopback, send ``requests`` from ``args.concurrency`` threads, stop;
    ``([(latency_ms, reply), ...], wall seconds)``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(service, path))
    url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def send(request: dict) -> tuple[float, dict]:
        data = json.dumps(request).encode()
        start = time.perf_counter()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            reply = json.loads(resp.read())
        return 1e3 * (time.perf_counter() - start), reply

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(send, requests))
    finally:
        server.shutdown()
        server.server_close()
    return results, time.perf_counter() - started


def _delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before[key] for key in COUNTERS}


def run(args: argparse.Namespace) -> dict:
    """Load ``--graph-cache``, serve the ``--mode``'s requests, stop; the report as a dict.

    ``at_load``: graph files accepted at start and graphs built while loading (always 0: files
    are deserialized at their first use, which counts as a ``load`` while serving).
    """
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("float16" if device.startswith("cuda") else "float32"))
    at_load = None
    if args.graph_cache:
        before = graph_cache.info()
        files = graph_cache.load(args.graph_cache)
        after = graph_cache.info()
        at_load = {"dir": str(args.graph_cache), "files": files,
                   "rejected_files": after["rejected_files"] - before["rejected_files"],
                   "builds": after["builds"] - before["builds"]}
    runner = run_decode if args.mode == "decode" else run_dense
    report = runner(args, device, dtype)
    report["at_load"] = at_load
    return report


def run_dense(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """Bucketed dense attention requests (``POST /attention``)."""
    policy = BucketPolicy(min_seq=args.min_seq, max_seq=args.max_seq, max_batch=args.max_batch)
    service = AttentionService(policy, device=device, dtype=dtype,
                               mask=ca.Causal("bottom_right") if args.causal else None,
                               backend=args.backend, check=args.check)
    rng = random.Random(args.seed)
    requests = []
    for i in range(args.requests):
        lens = [rng.randint(1, args.max_seq) for _ in range(rng.randint(1, args.max_batch))]
        requests.append({"heads": args.heads, "head_dim": args.head_dim, "seq_lens": lens,
                         "seed": i})
    before = graph_cache.info()
    results, wall = serve_requests(service, "/attention", requests, args)
    latencies = [ms for ms, _ in results]
    buckets = service.buckets.info()
    after = graph_cache.info()
    backends = sorted({reply["backend"] for _, reply in results})
    lookups = buckets["hits"] + buckets["misses"] + buckets["waits"]
    report = {
        "mode": "dense", "requests": len(results), "device": device, "dtype": str(dtype).removeprefix("torch."),
        "backends": backends, "policy": repr(policy),
        "buckets_used": buckets["misses"], "bucket_hits": buckets["hits"] + buckets["waits"],
        "hit_rate": (buckets["hits"] + buckets["waits"]) / lookups if lookups else 0.0,
        "graphs_built": buckets["misses"],
        "graph_cache": _delta(after, before),
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "compute_p50_ms": statistics.median(reply["compute_ms"] for _, reply in results),
        "throughput_rps": len(results) / wall, "max_err": service.max_err if args.check else None,
    }
    if "cudnn" in backends:
        # Real graphs: the process cache counts them (forward variants, plus backward ones if a
        # caller trained). Lookups are per plan, not per call, so the hit rate stays per bucket.
        report["graphs_built"] = report["graph_cache"]["builds"]
    return report


def decode_requests(args: argparse.Namespace, capacity: int) -> list[dict]:
    """``args.requests`` sequences: random prompt lengths and token counts that fit a slot."""
    rng = random.Random(args.seed)
    requests = []
    for i in range(args.requests):
        new = rng.randint(1, min(args.max_new_tokens, capacity - 1))
        requests.append({"prompt_len": rng.randint(1, capacity - new), "new_tokens": new,
                         "seed": i})
    return requests


def run_decode(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """Paged-KV decoding requests (``POST /generate``) through one ``DecodeService``."""
    shape = DecodeShape(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                        head_dim=args.head_dim, page_size=args.page_size,
                        max_blocks=args.max_blocks,
                        num_blocks=args.num_blocks or args.batch * args.max_blocks,
                        dtype=dtype, device=device)
    service = DecodeService(shape, backend=args.backend, check=args.check, seed=args.seed)
    stop = threading.Event()
    loop = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    before = graph_cache.info()
    loop.start()
    try:
        results, wall = serve_requests(service, "/generate", decode_requests(args, shape.capacity),
                                       args)
    finally:
        stop.set()
        loop.join()
    if service.error is not None:
        raise service.error
    after = graph_cache.info()
    stats = service.stats()
    counters = _delta(after, before)
    cudnn = stats["engine"] == "cudnn"
    steps = stats["steps"]
    latencies = [ms for ms, _ in results]
    report = {
        "mode": "decode", "requests": len(results), "device": device,
        "dtype": str(dtype).removeprefix("torch."), "backends": [stats["engine"]],
        "shape": {key: getattr(shape, key) for key in ("batch", "heads", "kv_heads", "head_dim",
                                                        "page_size", "max_blocks", "num_blocks")},
        **stats,
        # While serving: graphs built (cuDNN's, counted by graph_cache), and the share of steps
        # that built none. The torch engine builds no graph: there the stand-in is the call
        # signature (a step with a signature not seen before counts as a miss).
        "graphs_built": counters["builds"], "graph_cache": counters,
        "hit_rate": ((steps - stats["steps_with_graph_builds"]) / steps if cudnn and steps
                     else stats["signature_hit_rate"]),
        "hit_rate_source": "graph_cache builds per step" if cudnn else "call signatures",
        "graphs_note": ("cuDNN graphs, built or loaded through graph_cache" if cudnn else
                        f"the {stats['engine']} engine builds no cuDNN graphs"),
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "throughput_rps": len(results) / wall,
        "checksum": sum(reply["checksum"] for _, reply in results),
    }
    return report


def existing_dir(text: str) -> Path:
    """argparse type: a directory that exists (a typo must not serve with an empty cache)."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("dense", "decode"), default="dense",
                   help="dense: bucketed attention requests; decode: paged-KV decoding")
    p.add_argument("--requests", type=int, default=32, help="requests to send (default 32)")
    p.add_argument("--concurrency", type=int,
                   help="client threads (default 4; decode: 2 * --batch, to keep the slots full)")
    p.add_argument("--max-batch", type=int, default=8, help="largest request batch (default 8)")
    p.add_argument("--min-seq", type=int, default=128, help="smallest length bucket (default 128)")
    p.add_argument("--max-seq", type=int, help="longest request (default 2048 on cuda, 256 on cpu)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="no causal mask")
    p.add_argument("--backend", default="auto", choices=("auto", "cudnn", "cupy", "torch"),
                   help="engine of every call (default auto: the fastest that runs it)")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--check", action="store_true",
                   help="compare with the unpadded calls (dense) / dense float64 attention (decode)")
    p.add_argument("--graph-cache", type=existing_dir, metavar="DIR",
                   help="load saved graphs (cudnn-attn cache warm --save DIR) at start")
    d = p.add_argument_group("decode mode")
    d.add_argument("--batch", type=int, default=8, help="decode slots, the fixed batch (default 8)")
    d.add_argument("--kv-heads", type=int, default=2, help="K/V heads (default 2)")
    d.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    d.add_argument("--max-blocks", type=int, default=8,
                   help="pages per sequence: the cache capacity (default 8)")
    d.add_argument("--num-blocks", type=int, help="pages in the pool (default batch * max-blocks)")
    d.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests' inputs (default 0)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = 2 * args.batch if args.mode == "decode" else 4
    if args.max_seq is None:
        cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        args.max_seq = 2048 if cuda else 256
    for name in ("requests", "concurrency", "max_batch", "min_seq", "max_seq", "heads", "head_dim",
                 "batch", "kv_heads", "page_size", "max_blocks", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.min_seq = min(args.min_seq, args.max_seq)
    if args.page_size * args.max_blocks < 2:
        p.error("a slot must hold at least 2 tokens (--page-size * --max-blocks)")
    if args.num_blocks is not None and args.num_blocks <= args.max_blocks:
        p.error("--num-blocks must exceed --max-blocks (one page is the idle slots' scratch)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if report["at_load"] is not None:
        load = report["at_load"]
        print(f"graph cache {load['dir']}: {load['files']} file(s) loaded, "
              f"{load['rejected_files']} rejected, {load['builds']} graphs built at load")
    if report["mode"] == "decode":
        print_decode(report)
        return 0
    print(f"{report['requests']} requests on {report['device']} ({report['dtype']}), "
          f"backend(s) {', '.join(report['backends'])}")
    print(f"  {report['policy']}")
    print(f"  buckets used {report['buckets_used']}, hit rate {report['hit_rate']:.1%}, "
          f"graphs built {report['graphs_built']}")
    print(f"  latency p50 {report['p50_ms']:.2f} ms, p99 {report['p99_ms']:.2f} ms, "
          f"compute p50 {report['compute_p50_ms']:.2f} ms, {report['throughput_rps']:.1f} req/s")
    if report["max_err"] is not None:
        print(f"  max |padded - unpadded| on real rows: {report['max_err']:.3e}")
    return 0


def print_decode(report: dict) -> None:
    """The decode report, for people."""
    s = report["shape"]
    print(f"{report['requests']} requests decoded on {report['device']} ({report['dtype']}), "
          f"engine {report['engine']}")
    print(f"  {s['batch']} slots, H={s['heads']} H_kv={s['kv_heads']} D={s['head_dim']}, pages of "
          f"{s['page_size']}, {s['max_blocks']} per sequence, pool of {s['num_blocks']}")
    print(f"  {report['steps']} steps, {report['tokens']} tokens, {report['tokens_per_s']:.0f} "
          f"tokens/s; step p50 {report['step_p50_ms']:.2f} ms, p99 {report['step_p99_ms']:.2f} ms")
    print(f"  graphs built while serving {report['graphs_built']} ({report['graphs_note']}), "
          f"hit rate {report['hit_rate']:.1%} ({report['hit_rate_source']}), call signatures "
          f"{report['call_signatures']}")
    print(f"  request latency p50 {report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms")
    if report["mismatches"] is not None:
        print(f"  checked {report['compared_tokens']} tokens against dense float64 attention: "
              f"{report['mismatches']} mismatches, max |paged - dense| {report['max_err']:.3e}")


if __name__ == "__main__":
    sys.exit(main())
