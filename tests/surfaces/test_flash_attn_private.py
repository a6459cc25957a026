"""FlashAttention 2.8.3's private functions (``_flash_attn_forward`` & co.), its ``bert_padding``
helpers and ``integrations.flash_attn.register()``, against FlashAttention's published signatures
and a float64 brute force."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

import cudnn_attn.flash_attn_interface as fai
import cudnn_attn.integrations.flash_attn as ca_flash_attn
from cudnn_attn.compat.flash_attn import bert_padding

F64 = torch.float64

# flash-attn 2.8.3, flash_attn/flash_attn_interface.py: (args, defaults) of each function.
FA_283 = {
    "_flash_attn_forward": (
        ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
         "window_size_right", "softcap", "alibi_slopes", "return_softmax"], None),
    "_flash_attn_varlen_forward": (
        ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
         "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
         "softcap", "alibi_slopes", "return_softmax", "block_table", "leftpad_k", "seqused_k",
         "zero_tensors"],
        (-1, -1, 0.0, None, False, None, None, None, False)),
    "_flash_attn_backward": (
        ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
         "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
         "alibi_slopes", "deterministic", "rng_state"], (None,)),
    "_flash_attn_varlen_backward": (
        ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
         "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal",
         "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic",
         "rng_state", "zero_tensors"], (None, False)),
}


@pytest.mark.parametrize("name", sorted(FA_283))
def test_signature_is_flash_attn_2_8_3(name):
    fn = getattr(fai, name)
    assert inspect.isfunction(fn) and name in fai.__all__
    spec = inspect.getfullargspec(fn)
    assert (spec.args, spec.defaults) == FA_283[name]
    assert spec.varargs is None and spec.varkw is None and not spec.kwonlyargs


def _oracle(q, k, v, causal, window=(-1, -1), lens=None):
    """float64 brute force on [B, S, H, D]: (out, lse [B, H, S_q]); bottom-right causal/window."""
    q, k, v = (t.to(F64) for t in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    s = s.masked_fill(~vis, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), s.logsumexp(-1)


def _qkv(g, b=2, sq=7, sk=9, h=4, hk=2, d=8, dtype=F64):
    return [torch.randn(b, s, n, d, generator=g, dtype=dtype) for s, n in ((sq, h), (sk, hk), (sk, hk))]


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
def test_forward_returns_flash_attn_tuple(causal, window):
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g)
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(
        q, k, v, 0.0, q.shape[-1] ** -0.5, causal, *window, 0.0, None, False)
    ref_out, ref_lse = _oracle(q, k, v, causal, window)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert lse.shape == (2, 4, 7) and s_dmask.numel() == 0
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64


def test_forward_lse_is_float32_for_bf16():
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(g, dtype=torch.bfloat16)
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.5, True, -1, -1, 0.0, None, False)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_backward_writes_strided_views_and_uses_callers_out_and_lse():
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(g, sq=6, sk=6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = _oracle(*leaves, True)
    dout = torch.randn(ref_out.shape, generator=g, dtype=F64)
    want = torch.autograd.grad(ref_out, leaves, dout)
    out, lse, _, rng = fai._flash_attn_forward(q, k, v, 0.0, 8 ** -0.5, True, -1, -1, 0.0, None,
                                               False)
    # dq/dk/dv as strided views into larger buffers, as ring attention passes them.
    big = [torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=F64) for t in (q, k, v)]
    views = [b[..., ::2] for b in big]
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, *views, 0.0, 8 ** -0.5, True,
                                         -1, -1, 0.0, None, False, rng)
    for name, view, w in zip("qkv", views, want):
        torch.testing.assert_close(view, w, msg=f"d{name}")
    assert all(torch.isnan(b[..., 1::2]).all() for b in big)  # only the view was written
    torch.testing.assert_close(softmax_d, (dout * out).sum(-1).transpose(1, 2))
    # The caller's out is what the backward uses (softmax_d = rowsum(dout * out)).
    d2 = fai._flash_attn_backward(dout, q, k, v, 2 * out, lse, None, None, None, 0.0, 8 ** -0.5,
                                  True, -1, -1, 0.0, None, False)
    torch.testing.assert_close(d2, 2 * softmax_d)


def test_dropout_rng_state_replays_the_mask():
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(g, sq=5, sk=5, hk=4)
    torch.manual_seed(0)
    out, lse, _, rng = fai._flash_attn_forward(q, k, v, 0.3, 0.4, False, -1, -1, 0.0, None,
                                               False)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    # The same call through the autograd API with the same draw gives the same gradients.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(0)
    ref = fai.flash_attn_func(*leaves, dropout_p=0.3, softmax_scale=0.4)
    torch.testing.assert_close(out, ref.detach())
    want = torch.autograd.grad(ref, leaves, dout)
    got = [torch.empty_like(t) for t in (q, k, v)]
    fai._flash_attn_backward(dout, q, k, v, out, lse, *got, 0.3, 0.4, False, -1, -1, 0.0, None,
                             False, rng)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_varlen_forward_backward_against_per_sequence_oracle():
    g = torch.Generator().manual_seed(5)
    lens = [3, 7, 5]
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, 4, 8, generator=g, dtype=F64)
    k, v = (torch.randn(total, 2, 8, generator=g, dtype=F64) for _ in range(2))
    dout = torch.randn(total, 4, 8, generator=g, dtype=F64)
    out, lse, s_dmask, rng = fai._flash_attn_varlen_forward(q, k, v, cu, cu, 7, 7, 0.0,
                                                            8 ** -0.5, True)
    assert lse.shape == (4, total) and s_dmask.numel() == 0
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu, cu, 7, 7, 0.0,
                                    8 ** -0.5, True, -1, -1, 0.0, None, False, rng)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        leaves = [t[a:b][None].clone().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = _oracle(*leaves, True)
        torch.testing.assert_close(out[a:b], ref[0].detach())
        torch.testing.assert_close(lse[:, a:b], ref_lse[0].detach())
        want = torch.autograd.grad(ref, leaves, dout[a:b][None])
        for got, w in zip((dq, dk, dv), want):
            torch.testing.assert_close(got[a:b], w[0])


def _leftpad_case(g, lens_q, lens_k, pads, h=4, hk=2, d=8):
    cu_q, cu_k = (torch.tensor([0, *lens]).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    q = torch.randn(int(cu_q[-1]), h, d, generator=g, dtype=F64)
    k, v = (torch.randn(int(cu_k[-1]), hk, d, generator=g, dtype=F64) for _ in range(2))
    return q, k, v, cu_q, cu_k, torch.tensor(pads, dtype=torch.int32)


def _check_against_keys(out, lse, q, k, v, cu_q, cu_k, key_rows, causal, window):
    """Sequence ``b`` against the float64 oracle on keys ``key_rows[b]`` (a range of rows)."""
    for b, rows in enumerate(key_rows):
        a, e = cu_q[b].item(), cu_q[b + 1].item()
        if len(rows) == 0:  # no key: zeros and -inf (the package's convention)
            assert (out[a:e] == 0).all() and (lse[:, a:e] == float("-inf")).all()
            continue
        ref, ref_lse = _oracle(q[a:e][None], k[rows][None], v[rows][None], causal, window)
        ref = ref.nan_to_num(0.0)  # a row that sees no key (causal, S_q > S_k): zeros
        torch.testing.assert_close(out[a:e], ref[0])
        torch.testing.assert_close(lse[:, a:e], ref_lse[0])


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_varlen_leftpad_k_drops_each_sequences_first_keys(causal, window):
    # FlashAttention's block_info.h: keys of sequence b are rows cu_seqlens_k[b] + leftpad_k[b]
    # .. cu_seqlens_k[b + 1] - 1; masks align to them. Sequence 0 is padded too, and the last
    # sequence loses every key.
    g = torch.Generator().manual_seed(7)
    q, k, v, cu_q, cu_k, pads = _leftpad_case(g, [3, 4, 2, 3], [6, 5, 9, 3], [2, 0, 4, 3])
    out, lse, _, _ = fai._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, 4, 9, 0.0, 8 ** -0.5, causal, *window, leftpad_k=pads)
    starts, ends = cu_k[:-1] + pads, cu_k[1:]
    _check_against_keys(out, lse, q, k, v, cu_q, cu_k,
                        [range(s, e) for s, e in zip(starts.tolist(), ends.tolist())],
                        causal, window)


def test_varlen_leftpad_k_with_seqused_k_counts_the_padding():
    # FlashAttention: actual_seqlen_k = seqused_k[b] - leftpad_k[b], from the same start.
    g = torch.Generator().manual_seed(8)
    q, k, v, cu_q, cu_k, pads = _leftpad_case(g, [2, 5, 3], [7, 6, 8], [1, 3, 0])
    used = torch.tensor([5, 6, 4], dtype=torch.int32)
    out, lse, _, _ = fai._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, 5, 8, 0.0, 8 ** -0.5, True, leftpad_k=pads, seqused_k=used)
    rows = [range(s + p, s + n) for s, p, n in zip(cu_k[:-1].tolist(), pads.tolist(),
                                                   used.tolist())]
    _check_against_keys(out, lse, q, k, v, cu_q, cu_k, rows, True, (-1, -1))


def test_varlen_leftpad_k_bf16_matches_the_oracle_and_accepts_int64():
    g = torch.Generator().manual_seed(9)
    q, k, v, cu_q, cu_k, pads = _leftpad_case(g, [4, 4], [8, 6], [3, 1])
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    out, lse, _, _ = fai._flash_attn_varlen_forward(
        *low, cu_q, cu_k, 4, 8, 0.0, 8 ** -0.5, False, leftpad_k=pads.long())
    want, want_lse, _, _ = fai._flash_attn_varlen_forward(
        *(t.to(F64) for t in low), cu_q, cu_k, 4, 8, 0.0, 8 ** -0.5, False, leftpad_k=pads)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.to(F64), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.to(F64), want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("change,error,match", [
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), RuntimeError,
     "We don't support Paged KV and leftpad_k running at the same time yet"),
    (dict(leftpad_k=torch.zeros(1)), TypeError, "leftpad_k must be int32 or int64"),
    (dict(leftpad_k=torch.zeros(2, dtype=torch.int32)), ValueError,
     r"leftpad_k must have shape \(batch_size\) = \(1,\)"),
    (dict(leftpad_k=torch.tensor([5], dtype=torch.int32)), ValueError,
     r"leftpad_k\[0\] = 5 must be in \[0, 4\]"),
    (dict(leftpad_k=torch.tensor([-1], dtype=torch.int32)), ValueError,
     r"leftpad_k\[0\] = -1 must be in \[0, 4\]"),
    (dict(seqused_k=torch.tensor([2], dtype=torch.int32),
          leftpad_k=torch.tensor([3], dtype=torch.int32)), ValueError,
     r"leftpad_k\[0\] = 3 must be in \[0, 2\] \(sequence 0 has 2 keys in seqused_k\)"),
])
def test_varlen_leftpad_k_bad_input(change, error, match):
    q = torch.zeros(4, 1, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    kwargs = {"leftpad_k": torch.zeros(1, dtype=torch.int32), **change}
    with pytest.raises(error, match=match) as caught:
        fai._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, 1.0, False, **kwargs)
    assert isinstance(caught.value, RuntimeError)  # what FlashAttention's TORCH_CHECK raises


def test_varlen_zero_tensors_is_accepted():
    g = torch.Generator().manual_seed(10)
    q, k, v, cu_q, cu_k, _ = _leftpad_case(g, [3, 2], [3, 2], [0, 0])
    plain = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 3, 3, 0.0, 0.5, True)
    zeroed = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 3, 3, 0.0, 0.5, True,
                                            zero_tensors=True)
    torch.testing.assert_close(zeroed[0], plain[0])
    dout = torch.ones_like(q)
    d = fai._flash_attn_varlen_backward(dout, q, k, v, plain[0], plain[1], None, None, None,
                                        cu_q, cu_k, 3, 3, 0.0, 0.5, True, -1, -1, 0.0, None,
                                        False, None, True)
    assert d.shape == (4, 5)


def test_bert_padding_round_trip_and_lengths():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 2, generator=g, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    rows, idx, cu, max_len, used = bert_padding.unpad_input(x, mask)
    assert rows.shape == (9, 2) and cu.tolist() == [0, 2, 7, 9] and max_len == 5
    assert used.tolist() == [2, 5, 2] and cu.dtype == torch.int32
    torch.testing.assert_close(rows, x.reshape(15, 2)[mask.flatten().bool()])
    back = bert_padding.pad_input(rows, idx, 3, 5)
    torch.testing.assert_close(back, x * mask[..., None])
    (grad,) = torch.autograd.grad(back.sum(), x)
    torch.testing.assert_close(grad, mask[..., None].expand(3, 5, 2).to(F64))
    lengths = torch.tensor([[2, 3, 0, 0, 0], [5, 0, 0, 0, 0]])
    rows, idx, cu, max_len = bert_padding.unpad_input_for_concatenated_sequences(x[:2], lengths)
    assert cu.tolist() == [0, 2, 5, 10] and max_len == 5 and rows.shape == (10, 2)


@pytest.fixture
def clean_flash_attn():
    saved = {n: m for n, m in sys.modules.items() if n == "flash_attn" or n.startswith("flash_attn.")}
    for n in saved:
        del sys.modules[n]
    yield
    ca_flash_attn.unregister()
    for n in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[n]
    sys.modules.update(saved)


def test_register_makes_import_flash_attn_resolve_here(clean_flash_attn):
    module = ca_flash_attn.register()
    import flash_attn
    import flash_attn.bert_padding
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward, flash_attn_func

    assert flash_attn is module and flash_attn.__version__ == "2.8.3"
    assert flash_attn.flash_attn_func is fai.flash_attn_func is flash_attn_func
    assert _flash_attn_varlen_forward is fai._flash_attn_varlen_forward
    assert flash_attn.bert_padding is bert_padding
    assert ca_flash_attn.register() is module  # again: harmless
    import importlib.util
    assert importlib.util.find_spec("flash_attn") is not None  # find_spec does not raise
    ca_flash_attn.unregister()
    assert "flash_attn" not in sys.modules


def test_register_refuses_when_real_flash_attn_is_imported(clean_flash_attn):
    real = types.ModuleType("flash_attn")
    real.__file__ = "/site-packages/flash_attn/__init__.py"
    sys.modules["flash_attn"] = real
    with pytest.raises(RuntimeError, match="already imported.*/site-packages/flash_attn"):
        ca_flash_attn.register()
    assert sys.modules["flash_attn"] is real
