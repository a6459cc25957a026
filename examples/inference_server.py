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

import torch

import cudnn_attn as ca
from cudnn_attn.graphs.buckets import BucketPolicy, pad_to_bucket
from cudnn_attn.graphs.cache import GraphCache, graph_cache


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


def make_handler(service: AttentionService):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            try:
                if self.path != "/attention":
                    raise LookupError(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                reply, code = service.handle(json.loads(body)), 200
            except LookupError as exc:
                reply, code = {"error": f"unknown path {exc}"}, 404
            except (ValueError, TypeError, KeyError) as exc:
                reply, code = {"error": f"{type(exc).__name__}: {exc}"}, 400
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # keep the report readable
            pass

    return Handler


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def run(args: argparse.Namespace) -> dict:
    """Start the server, send the requests, stop; the report as a dict."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("float16" if device.startswith("cuda") else "float32"))
    policy = BucketPolicy(min_seq=args.min_seq, max_seq=args.max_seq, max_batch=args.max_batch)
    service = AttentionService(policy, device=device, dtype=dtype,
                               mask=ca.Causal("bottom_right") if args.causal else None,
                               backend=args.backend, check=args.check)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(service))
    url = f"http://127.0.0.1:{server.server_address[1]}/attention"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rng = random.Random(args.seed)
    requests = []
    for i in range(args.requests):
        lens = [rng.randint(1, args.max_seq) for _ in range(rng.randint(1, args.max_batch))]
        requests.append({"heads": args.heads, "head_dim": args.head_dim, "seq_lens": lens,
                         "seed": i})

    def send(request: dict) -> tuple[float, dict]:
        data = json.dumps(request).encode()
        start = time.perf_counter()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            reply = json.loads(resp.read())
        return 1e3 * (time.perf_counter() - start), reply

    before = graph_cache.info()
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(send, requests))
    finally:
        server.shutdown()
        server.server_close()
    wall = time.perf_counter() - started
    latencies = [ms for ms, _ in results]
    buckets = service.buckets.info()
    after = graph_cache.info()
    backends = sorted({reply["backend"] for _, reply in results})
    lookups = buckets["hits"] + buckets["misses"] + buckets["waits"]
    report = {
        "requests": len(results), "device": device, "dtype": str(dtype).removeprefix("torch."),
        "backends": backends, "policy": repr(policy),
        "buckets_used": buckets["misses"], "bucket_hits": buckets["hits"] + buckets["waits"],
        "hit_rate": (buckets["hits"] + buckets["waits"]) / lookups if lookups else 0.0,
        "graphs_built": buckets["misses"],
        "graph_cache": {key: after[key] - before[key]
                        for key in ("hits", "misses", "builds", "loads", "waits")},
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "compute_p50_ms": statistics.median(reply["compute_ms"] for _, reply in results),
        "throughput_rps": len(results) / wall, "max_err": service.max_err if args.check else None,
    }
    if "cudnn" in backends:
        # Real graphs: the process cache counts them (forward variants, plus backward ones if a
        # caller trained). Lookups are per plan, not per call, so the hit rate stays per bucket.
        report["graphs_built"] = report["graph_cache"]["builds"]
    return report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32, help="requests to send (default 32)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--max-batch", type=int, default=8, help="largest request batch (default 8)")
    p.add_argument("--min-seq", type=int, default=128, help="smallest length bucket (default 128)")
    p.add_argument("--max-seq", type=int, help="longest request (default 2048 on cuda, 256 on cpu)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-causal", dest="causal", action="store_false", help="no causal mask")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--check", action="store_true", help="compare with the unpadded calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.max_seq is None:
        cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        args.max_seq = 2048 if cuda else 256
    for name in ("requests", "concurrency", "max_batch", "min_seq", "max_seq", "heads", "head_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.min_seq = min(args.min_seq, args.max_seq)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
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


if __name__ == "__main__":
    sys.exit(main())
