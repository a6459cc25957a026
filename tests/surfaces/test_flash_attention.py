"""The tiled flash-attention teaching API (cudnn_attn.flash_attention) against a float64 brute force.

Covers O, l, m (m = row max of the scaled scores, l = row sum of exp(scaled - m)), odd sizes and tile
sizes that do not divide N, gradients (explicit backward, functional autograd, module autograd,
float64 gradcheck), use_half within FlashAttention's 2x (fwd) / 3x (bwd) rule against plain fp16
PyTorch, the block-size and memory helpers, and every error check.
"""

import math

import oracle
import pytest
import torch

from cudnn_attn import flash_attention as fa


def _inputs(B, H, N, D, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def brute_force(q, k, v):
    """float64 O, l, m written out directly (O also via the shared oracle)."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    s = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
    m = s.amax(dim=-1)
    l = torch.exp(s - m.unsqueeze(-1)).sum(dim=-1)
    out, lse = oracle.reference_attention(q, k, v)
    return out, l, m, lse


SHAPES = [  # (B, H, N, D, Bc, Br): N not a multiple of the tiles, tiles larger than N, N in {1, 2, 113}
    (2, 3, 113, 40, 32, 32),
    (1, 2, 113, 72, 16, 48),
    (2, 1, 113, 40, 7, 13),
    (1, 2, 113, 72, 64, 16),
    (2, 2, 2, 40, 32, 32),
    (1, 1, 1, 72, 32, 32),
    (1, 2, 1, 40, 1, 1),
    (3, 1, 17, 40, 64, 32),
]
SHAPE_IDS = [f"B{b}H{h}N{n}D{d}-Bc{bc}Br{br}" for b, h, n, d, bc, br in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forward_O_l_m_match_brute_force(shape, dtype):
    B, H, N, D, Bc, Br = shape
    q, k, v = _inputs(B, H, N, D, dtype, seed=N + D)
    O, l, m = fa.flash_attention_forward(q, k, v, Bc=Bc, Br=Br, return_softmax_stats=True)
    ref, ref_l, ref_m, ref_lse = brute_force(q, k, v)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert O.dtype == dtype and O.shape == (B, H, N, D)
    assert l.dtype == acc and m.dtype == acc and l.shape == m.shape == (B, H, N)
    assert torch.isfinite(O).all() and torch.isfinite(l).all() and torch.isfinite(m).all()
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(O.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(m.double(), ref_m, atol=tol, rtol=tol)
    torch.testing.assert_close(l.double(), ref_l, atol=tol, rtol=tol)
    torch.testing.assert_close((m + torch.log(l)).double(), ref_lse, atol=tol, rtol=tol)
    # plain call returns O alone, the same values
    torch.testing.assert_close(fa.flash_attention_forward(q, k, v, Bc=Bc, Br=Br), O, atol=0, rtol=0)


def test_default_tiles_and_l_at_least_one():
    q, k, v = _inputs(2, 2, 70, 40, torch.float32, seed=1)
    O, l, _m = fa.flash_attention_forward(q, k, v, return_softmax_stats=True)
    # the row maximum contributes exp(0) = 1, so l >= 1 and <= N
    assert (l >= 1 - 1e-6).all() and (l <= 70 + 1e-3).all()
    torch.testing.assert_close(O.double(), brute_force(q, k, v)[0], atol=2e-6, rtol=2e-6)


def test_empty_sequence():
    q, k, v = _inputs(2, 3, 0, 8, torch.float32)
    O, l, m = fa.flash_attention_forward(q, k, v, return_softmax_stats=True)
    assert O.shape == (2, 3, 0, 8) and l.shape == m.shape == (2, 3, 0)
    dq, dk, dv = fa.flash_attention_backward(q, k, v, O, torch.zeros_like(O), l, m)
    assert dq.shape == dk.shape == dv.shape == q.shape


def test_block_sizes_are_the_tiles_used(monkeypatch):
    calls = []
    real = fa._tile_ranges

    def spy(n, tile):
        calls.append((n, tile))
        return real(n, tile)

    monkeypatch.setattr(fa, "_tile_ranges", spy)
    q, k, v = _inputs(1, 1, 23, 8, torch.float32)
    O, l, m = fa.flash_attention_forward(q, k, v, Bc=5, Br=7, return_softmax_stats=True)
    assert sorted(calls) == [(23, 5), (23, 7)]
    assert [len(real(23, t)) for t in (5, 7)] == [5, 4] and real(23, 7)[-1] == (21, 23)
    calls.clear()
    fa.flash_attention_backward(q, k, v, O, torch.ones_like(O), l, m, Bc=6, Br=4)
    assert sorted(calls) == [(23, 4), (23, 6)]
    calls.clear()
    fa.FlashAttention(bc=3, br=11)(q, k, v)
    assert sorted(calls) == [(23, 3), (23, 11)]


# ----------------------------------------------------------------------------------------------------
# Gradients.
# ----------------------------------------------------------------------------------------------------

GRAD_SHAPES = [(2, 2, 113, 40, 32, 32), (1, 2, 113, 72, 16, 48), (2, 1, 37, 40, 7, 13),
               (1, 1, 2, 72, 32, 16), (1, 2, 1, 40, 1, 1)]


def _reference_grads(q, k, v, dO):
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    out, _ = oracle.reference_attention(*leaves)
    return torch.autograd.grad(out, leaves, dO.to(torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=[f"N{s[2]}D{s[3]}-Bc{s[4]}Br{s[5]}" for s in GRAD_SHAPES])
def test_explicit_backward_matches_autograd_of_brute_force(shape, dtype):
    B, H, N, D, Bc, Br = shape
    q, k, v = _inputs(B, H, N, D, dtype, seed=7 + N)
    dO = torch.randn(B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(dtype)
    O, l, m = fa.flash_attention_forward(q, k, v, Bc=Bc, Br=Br, return_softmax_stats=True)
    dq, dk, dv = fa.flash_attention_backward(q, k, v, O, dO, l, m, Bc=Bc, Br=Br)
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    for got, want in zip((dq, dk, dv), _reference_grads(q, k, v, dO)):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", GRAD_SHAPES[:3], ids=["113x40", "113x72", "37x40"])
def test_functional_and_module_autograd(shape):
    B, H, N, D, Bc, Br = shape
    q, k, v = _inputs(B, H, N, D, torch.float32, seed=11, requires_grad=True)
    dO = torch.randn(B, H, N, D)
    want = _reference_grads(q, k, v, dO)
    O = fa.flash_attention_forward(q, k, v, Bc=Bc, Br=Br)
    got = torch.autograd.grad(O, (q, k, v), dO)
    mod = fa.FlashAttention(bc=Bc, br=Br)
    got_mod = torch.autograd.grad(mod(q, k, v), (q, k, v), dO)
    for a, b, w in zip(got, got_mod, want):
        torch.testing.assert_close(a.double(), w, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_module_explicit_backward_equals_autograd():
    q, k, v = _inputs(2, 2, 29, 40, torch.float32, seed=5, requires_grad=True)
    mod = fa.FlashAttention(bc=8, br=16)
    O, l, m = mod(q, k, v, return_softmax_stats=True)
    assert not l.requires_grad and not m.requires_grad
    dO = torch.randn_like(O)
    auto = torch.autograd.grad(O, (q, k, v), dO)
    explicit = mod.backward(q.detach(), k.detach(), v.detach(), O.detach(), dO, l, m)
    for a, b in zip(auto, explicit):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert "bc=8, br=16, use_half=False" in repr(mod)


def test_gradcheck_float64():
    # float64 is supported (accumulation and statistics in float64), so gradcheck applies.
    q, k, v = _inputs(1, 2, 7, 5, torch.float64, seed=2, requires_grad=True)
    mod = fa.FlashAttention(bc=3, br=2)
    assert torch.autograd.gradcheck(mod, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)
    assert torch.autograd.gradcheck(lambda a, b, c: fa.flash_attention_forward(a, b, c, Bc=4, Br=5),
                                    (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_no_graph_without_grad():
    q, k, v = _inputs(1, 1, 9, 8, torch.float32, requires_grad=True)
    with torch.no_grad():
        O = fa.flash_attention_forward(q, k, v)
    assert O.grad_fn is None
    assert fa.flash_attention_forward(q, k, v).grad_fn is not None


# ----------------------------------------------------------------------------------------------------
# use_half: FlashAttention's rule, error <= 2x (forward) / 3x (backward) that of plain fp16 PyTorch.
# ----------------------------------------------------------------------------------------------------


def _rounding_noise(ref, dtype):
    return ((ref + 0.3 - 0.3).to(dtype).double() - ref).abs().max().item()


@pytest.mark.parametrize("shape", [(2, 2, 113, 40, 32, 32), (1, 2, 113, 72, 16, 48), (2, 1, 2, 40, 32, 32)],
                         ids=["113x40", "113x72", "2x40"])
def test_use_half_within_twice_plain_fp16_error(shape):
    B, H, N, D, Bc, Br = shape
    q64, k64, v64 = _inputs(B, H, N, D, torch.float64, seed=21)
    q16, k16, v16 = (t.half() for t in (q64, k64, v64))
    ref, _ = oracle.reference_attention(q16, k16, v16)  # fp64 on the fp16-rounded inputs
    base = oracle.plain_lowp_attention(q16, k16, v16)
    O, l, m = fa.flash_attention_forward(q64.float(), k64.float(), v64.float(), Bc=Bc, Br=Br, use_half=True,
                                         return_softmax_stats=True)
    assert O.dtype == torch.float16 and l.dtype == m.dtype == torch.float32
    err = (O.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert err <= 2 * base_err + _rounding_noise(ref, torch.float16), (err, base_err)
    # fp16 inputs without use_half: same storage dtype, same result
    same = fa.flash_attention_forward(q16, k16, v16, Bc=Bc, Br=Br)
    assert same.dtype == torch.float16
    torch.testing.assert_close(same, O, atol=0, rtol=0)

    # backward: 3x the error of plain fp16 autograd
    dO = torch.randn(B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want = _reference_grads(q16, k16, v16, dO.half())
    leaves16 = [t.clone().requires_grad_(True) for t in (q16, k16, v16)]
    base_g = torch.autograd.grad(oracle.plain_lowp_attention(*leaves16), leaves16, dO.half())
    leaves32 = [t.float().requires_grad_(True) for t in (q16, k16, v16)]
    O16 = fa.flash_attention_forward(*leaves32, Bc=Bc, Br=Br, use_half=True)
    got = torch.autograd.grad(O16, leaves32, dO.half())
    for g, b, w in zip(got, base_g, want):
        assert g.dtype == torch.float32  # gradient reaches the fp32 leaves through the fp16 cast
        e = (g.double() - w).abs().max().item()
        be = (b.double() - w).abs().max().item()
        assert e <= 3 * be + _rounding_noise(w, torch.float16), (e, be)


def test_use_half_explicit_backward_returns_fp16():
    q, k, v = _inputs(1, 2, 33, 40, torch.float32, seed=9)
    O, l, m = fa.flash_attention_forward(q, k, v, use_half=True, return_softmax_stats=True)
    grads = fa.flash_attention_backward(q, k, v, O, torch.randn(O.shape), l, m, use_half=True)
    assert all(g.dtype == torch.float16 and torch.isfinite(g).all() for g in grads)


# ----------------------------------------------------------------------------------------------------
# Block-size and memory helpers.
# ----------------------------------------------------------------------------------------------------

TABLE = {16: (128, 64), 17: (128, 64), 18: (64, 64), 40: (64, 64), 64: (64, 32), 72: (64, 32),
         80: (64, 32), 96: (32, 32), 128: (32, 32), 145: (32, 32), 160: (32, 16), 192: (16, 16),
         256: (16, 16), 512: (8, 8), 5068: (1, 1)}


@pytest.mark.parametrize("head_dim", sorted(TABLE))
def test_optimal_block_sizes_table(head_dim):
    bc, br = fa.get_optimal_block_sizes(4096, head_dim)
    assert (bc, br) == TABLE[head_dim] and isinstance(bc, int) and isinstance(br, int)
    budget = fa.PORTABLE_SMEM_BUDGET
    for dt in (torch.float32, torch.float16):
        assert fa.forward_smem_bytes(bc, br, head_dim, dt) <= budget
        assert fa.backward_smem_bytes(bc, br, head_dim, dt) <= budget
    # maximal: the previous (larger) rung of the ladder does not fit in float32
    rung = fa._TILE_LADDER.index((bc, br))
    if rung:
        pbc, pbr = fa._TILE_LADDER[rung - 1]
        assert max(fa.forward_smem_bytes(pbc, pbr, head_dim),
                   fa.backward_smem_bytes(pbc, pbr, head_dim)) > budget


def test_optimal_block_sizes_clip_to_sequence_and_run():
    assert fa.get_optimal_block_sizes(1, 64) == (1, 1)
    assert fa.get_optimal_block_sizes(2, 16) == (2, 2)
    assert fa.get_optimal_block_sizes(20, 16) == (32, 32)
    assert fa.get_optimal_block_sizes(113, 16) == (128, 64)
    assert fa.get_optimal_block_sizes(113, 72) == fa.get_optimal_block_sizes(113, 72)  # deterministic
    for N, D in [(113, 72), (50, 160), (9, 256)]:
        bc, br = fa.get_optimal_block_sizes(N, D)
        q, k, v = _inputs(1, 1, N, D, torch.float32, requires_grad=True)
        O = fa.flash_attention_forward(q, k, v, Bc=bc, Br=br)  # fwd + bwd tiles fit: no error
        O.sum().backward()


def test_smem_formulas_generalise_the_seed():
    # with Bc == Br the seed's flash.cu sizes: fwd 4*Bc*d*sizeof(T) + Bc*Br*4, bwd 5*Bc*d*sizeof(T) + 2*Bc*Br*4
    for b, d, dt, e in [(32, 64, torch.float32, 4), (64, 128, torch.float16, 2)]:
        assert fa.forward_smem_bytes(b, b, d, dt) == 4 * b * d * e + b * b * 4
        assert fa.backward_smem_bytes(b, b, d, dt) == 5 * b * d * e + 2 * b * b * 4
    assert fa.forward_smem_bytes(16, 8, 10) == 4 * (2 * 8 * 10 + 2 * 16 * 10) + 4 * 8 * 16
    assert fa.backward_smem_bytes(16, 8, 10, torch.float64) == 8 * (2 * 8 * 10 + 3 * 16 * 10) + 2 * 8 * 8 * 16
    assert fa.shared_memory_budget() == fa.shared_memory_budget("cpu") == 101376


@pytest.mark.parametrize("use_half", [False, True])
def test_estimate_memory_usage(use_half):
    B, H, N, D = 8, 16, 1024, 64
    info = fa.estimate_memory_usage(B, H, N, D, use_half=use_half)
    assert set(info) == {"input_memory", "internal_memory", "output_memory", "total_memory",
                         "total_memory_mb"}
    e = 2 if use_half else 4
    assert info["input_memory"] == 3 * B * H * N * D * e
    assert info["internal_memory"] == 2 * B * H * N * 4
    assert info["output_memory"] == B * H * N * D * e
    assert info["total_memory"] == info["input_memory"] + info["internal_memory"] + info["output_memory"]
    assert math.isclose(info["total_memory_mb"], info["total_memory"] / 2**20)
    # the estimate matches what the forward actually allocates for Q, K, V, O, l, m
    q, k, v = _inputs(1, 2, 5, 4, torch.float16 if use_half else torch.float32)
    O, l, m = fa.flash_attention_forward(q, k, v, use_half=use_half, return_softmax_stats=True)
    small = fa.estimate_memory_usage(1, 2, 5, 4, use_half=use_half)
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
    assert small["input_memory"] == nbytes(q, k, v)
    assert small["output_memory"] == nbytes(O)
    assert small["internal_memory"] == nbytes(l, m)


# ----------------------------------------------------------------------------------------------------
# Errors.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Bc", "Br"])
@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "32", None, 2048])
def test_bad_block_size_names_the_argument(name, bad):
    q, k, v = _inputs(1, 1, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=name):
        fa.flash_attention_forward(q, k, v, **{name: bad})
    O, l, m = fa.flash_attention_forward(q, k, v, return_softmax_stats=True)
    with pytest.raises(ValueError, match=name):
        fa.flash_attention_backward(q, k, v, O, O, l, m, **{name: bad})


@pytest.mark.parametrize("name", ["bc", "br"])
@pytest.mark.parametrize("bad", [0, -1, 3.0, False])
def test_module_bad_block_size(name, bad):
    with pytest.raises(ValueError, match=name):
        fa.FlashAttention(**{name: bad})


def test_tiles_over_the_shared_memory_budget():
    q, k, v = _inputs(1, 1, 8, 128, torch.float32)
    with pytest.raises(ValueError, match=r"Bc=128, Br=128 .*shared memory.*forward"):
        fa.flash_attention_forward(q, k, v, Bc=128, Br=128)
    # fits the forward (fp32 d=72: 90112 B) but not the backward (124928 B): fine without grad,
    # refused up front when a gradient will be needed, and refused by the explicit backward
    q, k, v = _inputs(1, 1, 8, 72, torch.float32)
    O, l, m = fa.flash_attention_forward(q, k, v, Bc=64, Br=64, return_softmax_stats=True)
    with pytest.raises(ValueError, match="backward"):
        fa.flash_attention_backward(q, k, v, O, O, l, m, Bc=64, Br=64)
    with pytest.raises(ValueError, match="backward"):
        fa.flash_attention_forward(*(t.requires_grad_(True) for t in (q, k, v)), Bc=64, Br=64)
    # use_half halves the storage: the same tiles fit
    fa.flash_attention_forward(q, k, v, Bc=64, Br=64, use_half=True).float().sum().backward()
    # the suggestion in the message is a valid choice
    q, k, v = _inputs(1, 1, 8, 256, torch.float32)
    with pytest.raises(ValueError, match=r"fits is \(Bc, Br\) = \(32, 16\)"):
        fa.flash_attention_forward(q, k, v)


def test_tensor_checks():
    q, k, v = _inputs(1, 2, 5, 8, torch.float32)
    f = fa.flash_attention_forward
    with pytest.raises(TypeError, match="Q must be a torch.Tensor"):
        f(q.tolist(), k, v)
    with pytest.raises(ValueError, match=r"K must be 4-D"):
        f(q, k[0], v)
    with pytest.raises(ValueError, match="same shape"):
        f(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="same shape"):
        f(q, k[..., :4], v[..., :4])
    with pytest.raises(TypeError, match="same dtype"):
        f(q, k.double(), v)
    with pytest.raises(TypeError, match=r"V has dtype torch.bfloat16"):
        f(q, k, v.bfloat16())
    with pytest.raises(TypeError, match=r"Q has dtype torch.int64"):
        f(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="same device"):
        f(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="head dimension"):
        f(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(TypeError, match="use_half"):
        f(q, k, v, use_half=1)
    with pytest.raises(TypeError, match="return_softmax_stats"):
        f(q, k, v, return_softmax_stats="yes")
    with pytest.raises(TypeError, match="use_half"):
        fa.FlashAttention(use_half=None)


def test_backward_checks():
    q, k, v = _inputs(1, 2, 5, 8, torch.float32)
    O, l, m = fa.flash_attention_forward(q, k, v, return_softmax_stats=True)
    dO = torch.randn_like(O)
    b = fa.flash_attention_backward
    with pytest.raises(ValueError, match=r"O must have shape Q's shape = \(1, 2, 5, 8\), got"):
        b(q, k, v, O[:, :1], dO, l, m)
    with pytest.raises(ValueError, match=r"dO must have shape Q's shape"):
        b(q, k, v, O, dO[..., :4], l, m)
    with pytest.raises(TypeError, match="dO must be a torch.Tensor"):
        b(q, k, v, O, None, l, m)
    with pytest.raises(TypeError, match=r"O has dtype torch.int32"):
        b(q, k, v, O.int(), dO, l, m)
    with pytest.raises(ValueError, match=r"l must have shape \[B, H, N\]"):
        b(q, k, v, O, dO, l[..., :3], m)
    with pytest.raises(ValueError, match=r"m must have shape \[B, H, N\]"):
        b(q, k, v, O, dO, l, m.unsqueeze(-1))
    with pytest.raises(TypeError, match="l must be a float tensor, got torch.int64"):
        b(q, k, v, O, dO, l.long(), m)
    with pytest.raises(ValueError, match="m is on meta"):
        b(q, k, v, O, dO, l, m.to("meta"))
    with pytest.raises(ValueError, match="same shape"):
        b(q, k[:, :1], v, O, dO, l, m)
    with pytest.raises(TypeError, match="use_half"):
        b(q, k, v, O, dO, l, m, use_half="no")


@pytest.mark.parametrize("args", [(0, 64), (64, 0), (-1, 64), (1.5, 64), (64, True), (16, 5069)])
def test_optimal_block_sizes_errors(args):
    with pytest.raises(ValueError):
        fa.get_optimal_block_sizes(*args)


@pytest.mark.parametrize("bad", [-1, 2.0, None, True])
def test_estimate_memory_usage_errors(bad):
    for i, name in enumerate(["batch_size", "num_heads", "seq_len", "head_dim"]):
        args = [2, 2, 2, 2]
        args[i] = bad
        with pytest.raises(ValueError, match=name):
            fa.estimate_memory_usage(*args)
    with pytest.raises(TypeError, match="use_half"):
        fa.estimate_memory_usage(1, 1, 1, 1, use_half="yes")


# ----------------------------------------------------------------------------------------------------
# GPU (marked): the same tiled torch code on a CUDA device.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_cuda_matches_oracle(dtype):
    q, k, v = (t.cuda().requires_grad_(True) for t in _inputs(2, 2, 113, 72, dtype, seed=8))
    budget = fa.shared_memory_budget(q.device)
    assert budget >= 48 * 1024
    O, l, m = fa.flash_attention_forward(q, k, v, Bc=32, Br=16, return_softmax_stats=True)
    assert O.device == q.device and O.dtype == dtype
    ref, ref_l, ref_m, _ = brute_force(q.detach().cpu(), k.detach().cpu(), v.detach().cpu())
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(O.detach().cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(m.cpu().double(), ref_m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l.cpu().double(), ref_l, atol=1e-4, rtol=1e-5)
    dO = torch.randn_like(O)
    got = torch.autograd.grad(O, (q, k, v), dO)
    want = _reference_grads(q.cpu(), k.cpu(), v.cpu(), dO.cpu())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu().double(), w, atol=tol * 10, rtol=tol * 10)
