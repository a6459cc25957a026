"""Attention over a sequence (and a 2-D grid) split across processes, checked against one device.

    torchrun --nproc-per-node 2 examples/context_parallel.py     # CPU: gloo; GPUs: NCCL
    python examples/context_parallel.py                          # starts 2 CPU processes itself

Each rank holds a shard of the sequence (zigzag, so causal work is balanced) and runs ring
attention; then each holds a band of rows of a 2-D grid and runs neighborhood attention by halo
exchange. Both are compared, forward and backward, with the whole computation on one device.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cudnn_attn as ca
from cudnn_attn import distributed as cp
from cudnn_attn import neighborhood as na


def check(rank: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    dtype = torch.float32

    # 1. Causal ring attention on a 1000-token sequence, GQA 8 -> 2 heads.
    q, k, v = (torch.randn(1, 1000, h, 64, generator=g).to(device, dtype) for h in (8, 2, 2))
    shards = [cp.shard_sequence(t, "zigzag").requires_grad_() for t in (q, k, v)]
    out = cp.context_parallel_attention(*shards, mask=ca.Causal(), sharding="zigzag")
    out.square().sum().backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = ca.attention(*full, mask=ca.Causal(), layout="bshd")
    want.square().sum().backward()
    out_err = (cp.unshard_sequence(out.detach(), "zigzag") - want.detach()).abs().max()
    dk_err = (cp.unshard_sequence(shards[1].grad, "zigzag") - full[1].grad).abs().max()

    # 2. A 7x7 neighborhood on a 40x40 grid, rows split across the ranks.
    grid = [torch.randn(1, 40, 40, 4, 32, generator=g).to(device, dtype) for _ in range(3)]
    rows = torch.tensor_split(torch.arange(40), dist.get_world_size())[rank]
    local = [t[:, rows[0]:rows[-1] + 1].clone().requires_grad_() for t in grid]
    na_out = cp.neighborhood_attention(*local, 7)
    na_out.sum().backward()
    whole = [t.clone().requires_grad_() for t in grid]
    na_want = na.na2d(*whole, 7)
    na_want.sum().backward()
    na_err = (na_out.detach() - na_want.detach()[:, rows[0]:rows[-1] + 1]).abs().max()
    dv_err = (local[2].grad - whole[2].grad[:, rows[0]:rows[-1] + 1]).abs().max()

    errors = torch.stack([out_err, dk_err, na_err, dv_err]).float()
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"ring attention, causal, {dist.get_world_size()} ranks: max |out - one device| "
              f"{errors[0]:.1e}, |dk| {errors[1]:.1e}")
        print(f"neighborhood 7x7 on 40x40 by halo exchange: max |out| {errors[2]:.1e}, "
              f"|dv| {errors[3]:.1e}")
    assert errors.max() < 1e-3, "sharded result differs from one device"


def run(rank: int, world: int, init: str) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                            world_size=world)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        check(rank, device)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Under torchrun the world size is torchrun's.")
    p.add_argument("--nproc", type=int, default=2,
                   help="CPU processes to start when not under torchrun (default 2)")
    args = p.parse_args(argv)  # before any process starts: --help only prints
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    if "RANK" in os.environ:  # started by torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(run, args=(args.nproc, f"file://{tmp}/init"), nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
