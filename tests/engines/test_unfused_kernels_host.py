"""CPU: the unfused NA kernels (``fallback_kernels/unfused.cu``) executed on the host.

No GPU runs here, so the kernels' float/double instances are compiled with g++ against the CUDA
shim ``tests/host_cuda/emu.h`` (real threads per block, grid-stride loops, ``__syncthreads``) and
driven through the real launchers of ``fallback_kernels.unfused`` (``qk_forward``, ``qk_backward``,
``av_forward``, ``av_backward``): only ``_Launch`` (which needs CuPy and a device) is replaced by
one that hands the same (grid, block, tensors + geometry table + scalars) to the host kernel, which
checks every packed argument against the kernel's parameter types. The launchers' pure-Python
``stride1_table`` (``geometry.neighborhood_table``) and ``launch_grid`` are therefore exercised as they are.

References: float64 brute force on the dtype-rounded inputs, with the NATTEN 0.17 slot layout built
from ``oracle.na_axis_neighbors`` (never from the library). Invalid slots of ``attn``/``d_attn``
inputs hold NaN (the kernels must never read them) and outputs are NaN-prefilled where the
launcher accepts an output buffer. Grids are capped at 2 x 2 blocks of 32 threads so the grid-stride
loops over both elements and (batch, head) pairs run several times.
"""

import functools
import itertools
import math

import numpy as np
import oracle
import pytest
import torch
from host_cuda import build

from cudnn_attn.fallback_kernels import unfused as U

HOST_DTYPES = {torch.float64: "double", torch.float32: "float"}
TOL = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-4}}


@pytest.fixture(scope="module")
def lib(request, tmp_path_factory):
    exprs = [v.expression for v in U.variants() if v.expression.endswith(("<float>", "<double>"))]
    assert len(exprs) == 8  # 4 kernels x {float, double}
    return build.host_library(request, tmp_path_factory, U, exprs)


class HostLaunch:
    """Stand-in for ``unfused._Launch``: same constructor and call, kernels run by the host
    library. Mirrors the real argument order: tensors, then the geometry table, then scalars."""

    lib = None
    calls = None  # list of (kernel, grid, threads), set per test

    def __init__(self, ref, spatial, kernel_size, dilation, is_causal):
        U._check_geometry(spatial, kernel_size, dilation, is_causal)
        self.dtype = ref.dtype
        self.table = torch.tensor(U.stride1_table(spatial, kernel_size, dilation, is_causal),
                                  dtype=torch.int32)

    def __call__(self, name, grid, threads, tensors, scalars):
        expression = f"{name}<{U._DTYPES[self.dtype]}>"
        assert expression in {v.expression for v in U.variants()}
        assert 0 not in grid and len(grid) <= 3 and all(g <= 65535 for g in grid[1:])
        assert 1 <= threads <= 1024
        if name == "na_rpb_backward":  # its tree reduction assumes blockDim == NA_RPB_THREADS
            assert threads == U.DEFINES["NA_RPB_THREADS"]
        HostLaunch.calls.append((name, tuple(grid), threads))
        self.lib[build.export_name(expression)](grid, (threads,),
                                                (*tensors, self.table, *scalars))


def _cpu_check_tensor(name, t, rank):
    # The launchers refuse CPU tensors; keep their type/dtype/rank checks without the device one.
    if not isinstance(t, torch.Tensor):
        raise TypeError(name)
    if t.dtype not in U._DTYPES or t.dim() != rank + 3:
        raise ValueError(name)


@pytest.fixture
def host_ops(lib, monkeypatch):
    """``unfused`` with its launches running on the host; grids capped at 2 x 2 blocks of 32
    threads (``launch_grid`` still sizes x for 256), so both grid-stride loops repeat."""
    monkeypatch.setattr(HostLaunch, "lib", lib)
    monkeypatch.setattr(HostLaunch, "calls", [])
    monkeypatch.setattr(U, "_Launch", HostLaunch)
    monkeypatch.setattr(U, "_check_tensor", _cpu_check_tensor)
    monkeypatch.setattr(U, "MAX_BLOCKS", 2)
    monkeypatch.setattr(U, "MAX_GRID_Y", 2)
    monkeypatch.setattr(U, "THREADS", 32)
    return U


# ---------------------------------------------------------------------------------------------
# Oracle: slot layout and float64 references
# ---------------------------------------------------------------------------------------------

@functools.cache
def slots(spatial, kernel, dilation, causal):
    """``key[i, s]``, ``valid[i, s]``, ``rpb_entry[i, s]`` (flat) of the NATTEN 0.17 layout."""
    N, KK = math.prod(spatial), math.prod(kernel)
    key = torch.zeros(N, KK, dtype=torch.long)
    valid = torch.zeros(N, KK, dtype=torch.bool)
    entry = torch.zeros(N, KK, dtype=torch.long)
    for i, qc in enumerate(itertools.product(*map(range, spatial))):
        wins = [sorted(oracle.na_axis_neighbors(L, x, k, 1, d, c))
                for L, x, k, d, c in zip(spatial, qc, kernel, dilation, causal)]
        for s, tc in enumerate(itertools.product(*map(range, kernel))):
            if all(t < len(w) for t, w in zip(tc, wins)):
                kc = [w[t] for t, w in zip(tc, wins)]
                key[i, s] = int(np.ravel_multi_index(kc, spatial))
                valid[i, s] = True
                entry[i, s] = int(np.ravel_multi_index(
                    [(j - x) // d + k - 1 for j, x, d, k in zip(kc, qc, dilation, kernel)],
                    [2 * k - 1 for k in kernel]))
    vis = oracle.neighborhood_visibility(spatial, kernel, 1, dilation, causal)
    for i in range(N):  # the layout holds exactly the oracle's neighbour set
        assert sorted(key[i][valid[i]].tolist()) == np.nonzero(vis[i])[0].tolist()
    return key, valid, entry


def references(spatial, kernel, dilation, causal, x):
    """float64 outputs of the 7 operations from the float64 inputs ``x``."""
    key, valid, entry = slots(spatial, kernel, dilation, causal)
    B, H = x["q"].shape[:2]
    flat = {n: t.reshape(B, H, -1, t.shape[-1]).clone().requires_grad_()
            for n, t in x.items() if n != "rpb"}
    rpb = x["rpb"].clone().requires_grad_() if x["rpb"] is not None else None
    zero = torch.zeros((), dtype=torch.float64)

    logits = (flat["q"][:, :, :, None] * flat["k"][:, :, key]).sum(-1)
    if rpb is not None:
        logits = logits + rpb.reshape(H, -1)[:, entry][None]
    d_attn = torch.where(valid, flat["d_attn"], zero)  # NaN in invalid slots -> no gradient
    grads = torch.autograd.grad(torch.where(valid, logits, zero), [flat["q"], flat["k"]]
                                + ([rpb] if rpb is not None else []), d_attn)
    attn = torch.where(valid, flat["attn"], zero)
    out = (attn[..., None] * flat["v"][:, :, key]).sum(-2)
    d_av, dv = torch.autograd.grad(out, [flat["attn"], flat["v"]], flat["d_out"])
    shape = lambda t: t.detach().reshape(B, H, *spatial, t.shape[-1])
    ref = {"attn": shape(torch.where(valid, logits, -math.inf)), "dq": shape(grads[0]),
           "dk": shape(grads[1]), "out": shape(out), "d_attn": shape(torch.where(valid, d_av, zero)),
           "dv": shape(dv)}
    if rpb is not None:
        ref["drpb"] = grads[2]
    return ref


def inputs(spatial, kernel, dilation, causal, dtype, B, H, D, use_rpb, seed=0):
    g = torch.Generator().manual_seed(seed)
    KK = math.prod(kernel)
    _, valid, _ = slots(spatial, kernel, dilation, causal)
    x = {n: torch.randn(B, H, *spatial, D, generator=g, dtype=torch.float64).to(dtype)
         for n in ("q", "k", "v", "d_out")}
    for n in ("attn", "d_attn"):  # invalid slots NaN: never read
        w = torch.randn(B, H, math.prod(spatial), KK, generator=g, dtype=torch.float64)
        x[n] = w.masked_fill(~valid, math.nan).reshape(B, H, *spatial, KK).to(dtype)
    x["rpb"] = (torch.randn(U.rpb_shape(H, kernel), generator=g, dtype=torch.float64).to(dtype)
                if use_rpb else None)
    return x


def run_all(ops, spatial, kernel, dilation, causal, x):
    geom = (kernel, dilation, causal)
    got = {}
    attn_buf = torch.full(x["attn"].shape, math.nan, dtype=x["q"].dtype)
    got["attn"] = ops.qk_forward(x["q"], x["k"], x["rpb"], *geom, attn=attn_buf)
    assert got["attn"] is attn_buf
    got["dq"], got["dk"], drpb = ops.qk_backward(x["d_attn"], x["q"], x["k"], *geom,
                                                 x["rpb"] is not None)
    if drpb is not None:
        got["drpb"] = drpb
    out_buf = torch.full(x["v"].shape, math.nan, dtype=x["v"].dtype)
    got["out"] = ops.av_forward(x["attn"], x["v"], *geom, out=out_buf)
    assert got["out"] is out_buf
    got["d_attn"], got["dv"] = ops.av_backward(x["d_out"], x["attn"], x["v"], *geom)
    return got


def check(got, ref, dtype):
    assert set(got) == set(ref)
    for name, r in ref.items():
        g = got[name]
        assert not torch.isnan(g).any(), f"{name}: NaN (an unwritten element or a read invalid slot)"
        # drpb comes back in the accumulator type (float64 for float64, else float32).
        assert g.dtype == (dtype if name != "drpb" else
                           (torch.float64 if dtype == torch.float64 else torch.float32)), name
        torch.testing.assert_close(g.double(), r, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


# name -> (spatial, kernel, dilation, causal); rpb where NATTEN 0.17 allows it (odd, non-causal).
CASES = {
    "1d": ((9,), (3,), (1,), (False,)),
    "1d-dilated": ((10,), (3,), (3,), (False,)),
    "1d-causal-dilated": ((11,), (4,), (2,), (True,)),
    "1d-even": ((8,), (4,), (1,), (False,)),
    "1d-full": ((7,), (7,), (1,), (False,)),
    "2d": ((7, 9), (3, 5), (2, 1), (False, False)),
    "2d-causal-one-axis": ((7, 9), (3, 4), (2, 1), (False, True)),
    "2d-causal-both": ((6, 5), (2, 3), (3, 1), (True, True)),
    "3d": ((4, 5, 6), (3, 3, 3), (1, 1, 2), (False, False, False)),
    "3d-causal-first": ((5, 6, 7), (3, 3, 5), (1, 2, 1), (True, False, False)),
    "3d-causal-last": ((6, 5, 4), (3, 5, 3), (2, 1, 1), (False, True, True)),
}


def _rpb_allowed(kernel, causal):
    return not any(causal) and all(k % 2 for k in kernel)


@pytest.mark.parametrize("dtype", list(HOST_DTYPES), ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", list(CASES))
def test_seven_ops_match_oracle(host_ops, name, dtype):
    spatial, kernel, dilation, causal = CASES[name]
    x = inputs(spatial, kernel, dilation, causal, dtype, B=2, H=3, D=5,
               use_rpb=_rpb_allowed(kernel, causal))
    ref = references(spatial, kernel, dilation, causal,
                     {n: (t.double() if t is not None else None) for n, t in x.items()})
    check(run_all(host_ops, spatial, kernel, dilation, causal, x), ref, dtype)
    # Capped grids: the (batch, head) loop repeats (6 pairs, 2 rows of blocks).
    grids = [c[1] for c in HostLaunch.calls if c[0] != "na_rpb_backward"]
    assert len(grids) == 6 and all(g[0] <= 2 and g[1] == 2 for g in grids)


def test_uncapped_launch_grid_covers_everything(lib, monkeypatch):
    """The real ``launch_grid`` (no caps): one pass, every element owned by one thread."""
    monkeypatch.setattr(HostLaunch, "lib", lib)
    monkeypatch.setattr(HostLaunch, "calls", [])
    monkeypatch.setattr(U, "_Launch", HostLaunch)
    monkeypatch.setattr(U, "_check_tensor", _cpu_check_tensor)
    spatial, kernel, dilation, causal = (9, 13), (3, 5), (1, 2), (False, False)
    x = inputs(spatial, kernel, dilation, causal, torch.float32, B=1, H=2, D=3, use_rpb=True)
    ref = references(spatial, kernel, dilation, causal,
                     {n: (t.double() if t is not None else None) for n, t in x.items()})
    check(run_all(U, spatial, kernel, dilation, causal, x), ref, torch.float32)
    dot = next(c for c in HostLaunch.calls if c[0] == "na_neighbor_dot")
    assert dot[1] == (math.ceil(9 * 13 * 15 / 256), 2)


def test_random_geometries_float64(host_ops):
    """Random ranks, sizes, kernels, dilations and causal flags; float64 (exact up to rounding)."""
    rng = np.random.default_rng(4)
    for _ in range(8):
        rank = int(rng.integers(1, 4))
        spatial, kernel, dilation, causal = [], [], [], []
        for _ in range(rank):
            L = int(rng.integers(2, 9))
            k = int(rng.integers(2, L + 1))
            spatial.append(L)
            kernel.append(k)
            dilation.append(int(rng.integers(1, L // k + 1)))
            causal.append(bool(rng.random() < 0.4))
        geom = tuple(map(tuple, (spatial, kernel, dilation, causal)))
        x = inputs(*geom, torch.float64, B=1, H=2, D=int(rng.integers(1, 7)),
                   use_rpb=_rpb_allowed(kernel, causal), seed=int(rng.integers(1 << 30)))
        ref = references(*geom, {n: (t.double() if t is not None else None) for n, t in x.items()})
        check(run_all(host_ops, *geom, x), ref, torch.float64)


def test_argument_packing_is_checked(lib):
    """The host kernel refuses what a GPU launch would misread (guards the tests above)."""
    k = lib[build.export_name("na_neighbor_gather<float>")]
    assert k.signature == ("pf4", "pf4", "pf4", "pi4", "i4", "i4")
    w, b, out = (torch.zeros(2, 3, 4) for _ in range(3))
    table = torch.tensor(U.stride1_table((3,), (2,), (1,), (False,)), dtype=torch.int32)
    with pytest.raises(TypeError, match="scalar"):
        k((1,), (32,), (w, b, out, table, np.int64(2), np.int32(4)))
    with pytest.raises(TypeError, match="dtype"):
        k((1,), (32,), (w.double(), b, out, table, np.int32(2), np.int32(4)))
    with pytest.raises(TypeError, match="takes 6"):
        k((1,), (32,), (w, b, out, table, np.int32(2)))


def test_real_threads_match_oracle(request, tmp_path_factory, monkeypatch):
    """The same kernels with every block run on real std::threads (races and barriers as on
    hardware rather than the fibers' fixed interleaving); one 2-D case with rpb."""
    exprs = [v.expression for v in U.variants() if v.expression.endswith("<float>")]
    lib = build.host_library(request, tmp_path_factory, U, exprs, real_threads=True)
    monkeypatch.setattr(HostLaunch, "lib", lib)
    monkeypatch.setattr(HostLaunch, "calls", [])
    monkeypatch.setattr(U, "_Launch", HostLaunch)
    monkeypatch.setattr(U, "_check_tensor", _cpu_check_tensor)
    monkeypatch.setattr(U, "MAX_BLOCKS", 2)
    spatial, kernel, dilation, causal = (5, 4), (3, 3), (1, 1), (False, False)
    x = inputs(spatial, kernel, dilation, causal, torch.float32, B=1, H=1, D=4, use_rpb=True)
    ref = references(spatial, kernel, dilation, causal,
                     {n: (t.double() if t is not None else None) for n, t in x.items()})
    check(run_all(U, spatial, kernel, dilation, causal, x), ref, torch.float32)
