"""A paged-KV decode step captured once in a CUDA graph and replayed with new lengths.

Run on a CUDA machine:  python examples/cuda_graph_decode.py [--steps 64] [--slots 8]

Every decode step of a server is the same call with other numbers: the new tokens' queries, the
lengths of the caches (``cache_seqlens``) and the page tables. With the lengths and tables as
device tensors, ``attention_with_kvcache`` reads nothing on the host and builds nothing after its
first call (one cuDNN graph serves every step), so the step can be captured in a
``torch.cuda.CUDAGraph`` and replayed: a replay launches the captured kernels without running any
Python. Each step here writes the new lengths and queries into the captured tensors, replays,
and checks the result against the same call run eagerly. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from cudnn_attn.varlen import attention_with_kvcache


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Capture a paged-KV decode step in a CUDA "
                                                 "graph and replay it with new lengths.")
    parser.add_argument("--steps", type=int, default=64, help="decode steps to replay")
    parser.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--heads", type=int, default=16, help="query heads (4 per kv head)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    parser.add_argument("--pages-per-slot", type=int, default=32,
                        help="cache capacity of a sequence, in pages")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_decode.py needs a CUDA GPU; torch sees none here. Nothing was run.")
        return 0
    dev, dtype, d, kv_heads = "cuda", torch.bfloat16, 128, max(1, args.heads // 4)
    pages = args.slots * args.pages_per_slot
    k_pool, v_pool = (torch.randn(pages, args.page_size, kv_heads, d, device=dev, dtype=dtype)
                      for _ in range(2))
    # Static inputs of the captured step: written in place before every replay.
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(args.slots, -1)
    lengths = torch.randint(1, args.page_size * 4, (args.slots,), device=dev, dtype=torch.int32)
    q = torch.randn(args.slots, 1, args.heads, d, device=dev, dtype=dtype)

    def step():
        return attention_with_kvcache(q, k_pool, v_pool, lengths, block_table=table,
                                      backend="cudnn")

    side = torch.cuda.Stream()  # warm up (graph build, workspace) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    capacity = args.page_size * args.pages_per_slot
    worst, replay_s, eager_s = 0.0, 0.0, 0.0
    for _ in range(args.steps):
        lengths.add_(1).clamp_(max=capacity)  # each sequence grew by one token (on the device)
        q.copy_(torch.randn_like(q))
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        replay_s += time.perf_counter() - start
        start = time.perf_counter()
        eager = step()
        torch.cuda.synchronize()
        eager_s += time.perf_counter() - start
        worst = max(worst, (out.float() - eager.float()).abs().max().item())
    print(f"{args.steps} replayed steps, {args.slots} slots: max |replay - eager| = {worst:.3g}; "
          f"replay {1e6 * replay_s / args.steps:.1f} us/step, eager {1e6 * eager_s / args.steps:.1f}"
          f" us/step (each with a synchronisation)")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
