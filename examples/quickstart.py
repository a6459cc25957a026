"""cudnn_attn in 30 lines: one call, composable masks, explain(), packed variable-length batches.

    python examples/quickstart.py            # picks CUDA when available, else the CPU
"""

import argparse

import torch

import cudnn_attn as ca


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {"device": dev, "dtype": torch.float16 if dev == "cuda" else torch.float32}
    q, k, v = (torch.randn(2, 8, 128, 64, **kw) for _ in range(3))         # [B, H, S, D]

    out = ca.attention(q, k, v, mask=ca.Causal())                          # causal LM attention
    local = ca.attention(q, k, v, mask=ca.Causal() & ca.SlidingWindow(16, 0), bias=ca.Alibi())
    gqa, lse = ca.attention(q, k[:, :2], v[:, :2], return_lse=True)        # 8 query heads, 2 kv heads
    x = torch.randn(1, 4, 16 * 16, 32, **kw)                               # a 16x16 token grid
    na = ca.attention(x, x, x, mask=ca.Neighborhood((16, 16), (5, 5)))     # NATTEN 2-D, 5x5 window
    print("shapes:", *(tuple(t.shape) for t in (out, local, gqa, lse, na)))

    print(ca.explain(q, k, v, mask=ca.Causal()))                           # who runs it, and why not

    lens = [5, 1, 12]                                                      # three packed sequences
    cu = torch.tensor([0, 5, 6, 18], dtype=torch.int32, device=dev)        # cumulative lengths
    qp, kp, vp = (torch.randn(sum(lens), 4, 32, **kw) for _ in range(3))   # [total, H, D]
    packed = ca.attention_varlen(qp, kp, vp, cu, cu, max(lens), max(lens), mask=ca.Causal())
    last = ca.attention(qp[None, 6:], kp[None, 6:], vp[None, 6:], layout="bshd", mask=ca.Causal())
    err = (packed[6:] - last[0]).abs().max().item()
    print(f"varlen: out {tuple(packed.shape)}, sequence 3 alone differs by {err:.1e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
