"""NATTEN 0.21's hard-coded ``test_fna.py`` grids (reference section 4.1), shrunk to CPU size, through
``cudnn_attn.neighborhood.na{1,2,3}d`` on the torch engine: forward (out, lse) and backward
(dq, dk, dv with ``d_out = 0.05 * randn``) vs a float64 brute force, in fp32 with NATTEN's cutlass-fna
fp32 tolerances (atol, rtol=0): out 1e-4, dq 1e-2, dk 1e-4, dv 1e-4. Every causal combination.

Shrinking keeps each case's (kernel, stride, dilation) exactly: an axis of length ``L`` becomes
``min(L, max(k*d + min(k, max(s, 16)), 8))`` (so ``k*d <= L'``, and unless ``k*d == L`` the window
still moves by at least a stride group, or 16 tokens for the 2048-token kernels); heads
drop to at most 2 (the GQA ratio kept as far as possible), head_dim to 16, batch to at most 2;
``D_v`` alternates between ``D`` and ``D + 8`` as NATTEN's ``head_dim_v`` sweep does.

By default each grid entry runs non-causal and one causal combination, rotating over the entries so
that every combination of causal axes runs (``full_sweep.rotate``); ``CUDNN_ATTN_FULL_SWEEP=1`` runs
every combination of every entry.
"""

import itertools

import na_oracle
import pytest
import torch
from full_sweep import rotate

from cudnn_attn import neighborhood as N

TOL = {"out": 1e-4, "lse": 1e-4, "dq": 1e-2, "dk": 1e-4, "dv": 1e-4}

# (batch, heads, heads_kv, head_dim, input_shape, kernel_size, stride, dilation), verbatim.
GRID = [
    (4, 3, 3, 128, (256,), (255,), (82,), 1), (4, 3, 1, 128, (256,), (255,), (82,), 1),
    (2, 4, 4, 128, (128,), (63,), (31,), 1), (2, 4, 2, 128, (128,), (63,), (31,), 1),
    (2, 4, 1, 128, (128,), (63,), (31,), 1), (1, 1, 1, 128, (2048,), (2048,), (1,), 1),
    (1, 1, 1, 128, (32768,), (2048,), (2048,), 1), (1, 1, 1, 128, (32768,), (2048,), (256,), 1),
    (1, 1, 1, 128, (32768,), (2048,), (128,), 1), (1, 1, 1, 128, (32768,), (2048,), (1,), 1),
    (1, 1, 1, 32, (128,), (3,), (1,), 1), (1, 1, 1, 32, (128,), (3,), (2,), 5),
    (1, 2, 2, 64, (128,), (15,), (1,), 1), (1, 1, 1, 32, (128,), (3,), (2,), 10),
    (1, 1, 1, 64, (128,), (8,), (7,), 5), (1, 1, 1, 128, (128,), (61,), (33,), 1),
    (1, 1, 1, 32, (125,), (3,), (1,), 1), (1, 2, 2, 64, (125,), (15,), (1,), 1),
    (1, 1, 1, 128, (256,), (3,), (2,), 10),
    (1, 4, 4, 32, (5, 25), (5, 16), (1, 16), (1, 1)), (1, 4, 2, 32, (5, 25), (5, 16), (1, 16), (1, 1)),
    (1, 4, 1, 32, (5, 25), (5, 16), (1, 16), (1, 1)), (1, 1, 1, 32, (84, 19), (7, 3), (1, 1), (5, 1)),
    (1, 1, 1, 128, (19, 29), (8, 8), (1, 1), (2, 3)), (1, 1, 1, 128, (48, 17), (24, 16), (1, 1), (2, 1)),
    (1, 1, 1, 128, (67, 80), (12, 7), (8, 4), (5, 11)), (1, 1, 1, 128, (8, 8), (8, 8), (1, 1), (1, 1)),
    (1, 1, 1, 128, (33, 33), (24, 16), (1, 1), (1, 1)), (1, 1, 1, 32, (16, 16), (16, 16), (1, 1), (1, 1)),
    (1, 1, 1, 128, (44, 80), (44, 80), (1, 1), (1, 1)), (1, 1, 1, 32, (40, 20), (3, 7), (1, 1), (1, 1)),
    (1, 1, 1, 32, (16, 16), (3, 3), (1, 1), (1, 1)), (1, 1, 1, 128, (44, 80), (9, 10), (1, 1), (1, 1)),
    (1, 1, 1, 64, (28, 40), (17, 31), (1, 1), (1, 1)), (1, 1, 1, 64, (36, 40), (36, 40), (12, 13), (1, 1)),
    (1, 1, 1, 128, (44, 80), (44, 80), (4, 8), (1, 1)),
    (4, 8, 8, 64, (32, 10, 10), (7, 3, 3), (5, 1, 1), (1, 2, 3)),
    (1, 4, 4, 32, (8, 8, 16), (3, 3, 3), (2, 1, 2), (2, 2, 4)),
    (1, 4, 1, 32, (8, 8, 16), (3, 3, 3), (2, 1, 2), (2, 2, 4)),
    (1, 1, 1, 64, (18, 37, 12), (14, 16, 12), (12, 8, 1), (1, 2, 1)),
    (1, 1, 1, 32, (13, 11, 9), (3, 4, 3), (2, 3, 3), (3, 2, 2)),
    (1, 1, 1, 32, (16, 16, 16), (16, 16, 16), (1, 1, 1), (1, 1, 1)),
    (1, 1, 1, 32, (8, 4, 8), (7, 3, 7), (1, 1, 1), (1, 1, 1)),
    (1, 1, 1, 32, (16, 16, 16), (16, 16, 16), (2, 4, 5), (1, 1, 1)),
]


def shrink(case, index):
    B, H, Hkv, D, shape, kernel, stride, dilation = case
    rank = len(shape)
    dilation = na_oracle.per_axis(dilation, rank)
    shape = tuple(min(L, max(k * d + min(k, max(s, 16)), 8))
                  for L, k, s, d in zip(shape, kernel, stride, dilation))
    heads = min(H, 2)
    heads_kv = heads if Hkv == H else 1
    D = 16
    return min(B, 2), heads, heads_kv, D, D + 8 * (index % 2), shape, kernel, stride, dilation


PARAMS = [
    pytest.param(i, causal, id=f"{len(c[4])}d-{i}-c" + "".join("TF"[not x] for x in causal))
    for i, c in enumerate(GRID)
    for causal in rotate(itertools.product((False, True), repeat=len(c[4])), i)
]


@pytest.mark.parametrize("index,causal", PARAMS)
def test_natten_grid(index, causal):
    B, H, Hkv, D, Dv, shape, kernel, stride, dilation = shrink(GRID[index], index)
    g = torch.Generator().manual_seed(index)
    q, k, v = (torch.randn(B, *shape, h, dim, generator=g, dtype=torch.float64)
               for h, dim in ((H, D), (Hkv, D), (Hkv, Dv)))
    dout = 0.05 * torch.randn(B, *shape, H, Dv, generator=g, dtype=torch.float64)
    ref = na_oracle.chunked_na_fwd_bwd(q, k, v, dout, shape, kernel, stride, dilation, causal)
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    fn = {1: N.na1d, 2: N.na2d, 3: N.na3d}[len(shape)]
    out, lse = fn(*leaves, kernel, stride, dilation, causal, return_lse=True)
    got = (out, lse, *torch.autograd.grad(out, leaves, dout.float()))
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert a.dtype == torch.float32 and a.shape == e.shape, name
        torch.testing.assert_close(a.double(), e, atol=TOL[name], rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")
