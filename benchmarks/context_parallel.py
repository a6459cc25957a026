"""Context parallelism on CPU processes (gloo): bytes each rank sends and time per step, ring
attention vs the neighborhood halo exchange, on the same 2-D neighborhood problem.

Run from the repository root:  python benchmarks/context_parallel.py [--ranks 2 4] [--grid 48]

For a 2-D grid ``G x G`` (B=1, H=4, D=32, fp32) with a ``k x k`` neighborhood, sharded along the
first axis:
  * halo: cudnn_attn.distributed.neighborhood_attention — each rank fetches the rows its
    windows reach; the result is exact neighborhood attention.
  * ring: cudnn_attn.distributed.context_parallel_attention on the flattened tokens — what a
    user without halo support runs: every K/V block travels the ring (and it computes *dense*
    attention, which is not the same result; it is here for the traffic and the time).
Both run forward + backward; ``bytes/rank`` is the mean over ranks of what each sent (the p2p
payload, counted at the send). Prints a table; writes benchmarks/results/context_parallel-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

import _report
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, args, init_file, out_file):
    from cudnn_attn import distributed as cp
    from cudnn_attn.distributed.p2p import Exchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(0)
    grid, k = args.grid, args.kernel
    full = [torch.randn(1, grid, grid, 4, 32, generator=g) for _ in range(3)]
    rows = torch.tensor_split(torch.arange(grid), world)[rank]
    halo_in = [t[:, rows[0]:rows[-1] + 1].clone().requires_grad_() for t in full]
    flat = [t.reshape(1, grid * grid, 4, 32) for t in full]
    ring_in = [cp.shard_sequence(t, "contiguous").requires_grad_() for t in flat]
    results = {}
    for name, step in (
            ("halo", lambda: cp.neighborhood_attention(*halo_in, k).sum().backward()),
            ("ring", lambda: cp.context_parallel_attention(
                *ring_in, sharding="contiguous").sum().backward())):
        step()  # warm-up
        dist.barrier()
        Exchange.bytes_sent = 0
        start = time.perf_counter()
        for _ in range(args.repeats):
            step()
        dist.barrier()
        results[name] = {"ms_per_step": 1000 * (time.perf_counter() - start) / args.repeats,
                         "bytes_per_step": Exchange.bytes_sent / args.repeats}
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        Path(out_file).write_text(json.dumps(every))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--grid", type=int, default=48, help="G of the G x G grid (default 48)")
    parser.add_argument("--kernel", type=int, default=7, help="neighborhood size (default 7)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "out.json")
            mp.spawn(_worker, args=(world, args, str(Path(tmp, "init")), str(out)), nprocs=world)
            per_rank = json.loads(out.read_text())
        for method in ("halo", "ring"):
            sent = [r[method]["bytes_per_step"] for r in per_rank]
            rows.append({"ranks": world, "method": method,
                         "MB/rank (mean)": sum(sent) / world / 2**20,
                         "MB/rank (max)": max(sent) / 2**20,
                         "ms/step": max(r[method]["ms_per_step"] for r in per_rank)})
        halo, ring = rows[-2], rows[-1]
        rows[-2]["ring/halo bytes"] = ring["MB/rank (mean)"] / max(halo["MB/rank (mean)"], 1e-12)
    _report.print_table(rows, ["ranks", "method", "MB/rank (mean)", "MB/rank (max)", "ms/step",
                               "ring/halo bytes"])
    path = _report.write_json("context_parallel", {
        "problem": {"grid": [args.grid, args.grid], "kernel": args.kernel, "B": 1, "H": 4,
                    "D": 32, "dtype": "float32", "steps": "forward+backward"},
        "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
