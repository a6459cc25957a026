"""Shape bucketing: bounded distinct shapes/keys, and padding that leaves the real rows unchanged."""

from __future__ import annotations

import random

import oracle
import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.graphs.buckets import BucketPolicy, pad_to_bucket


def test_power_of_two_buckets():
    p = BucketPolicy(min_seq=128, max_seq=1000, min_batch=1, max_batch=6)
    assert p.seq_buckets == (128, 256, 512, 1000)
    assert p.query_buckets == p.seq_buckets
    assert p.batch_buckets == (1, 2, 4, 6)
    assert p.num_shapes == 4 * 4 * 4
    default = BucketPolicy()
    assert default.seq_buckets[0] == 128 and all(b % 128 == 0 for b in default.seq_buckets)
    assert BucketPolicy(min_seq=64, max_seq=64).seq_buckets == (64,)


def test_explicit_buckets_are_sorted_and_deduplicated():
    p = BucketPolicy([512, 128, 512, 2048], query_buckets=[1, 16, 128], batch_buckets=[8, 1])
    assert p.seq_buckets == (128, 512, 2048)
    assert p.query_buckets == (1, 16, 128)
    assert p.batch_buckets == (1, 8)
    assert p.bucket(3, 1, 300) == (8, 1, 512)
    assert p.bucket(1, 17, 17) == (1, 128, 128)


def test_round_up_is_the_smallest_bucket_not_below():
    p = BucketPolicy(min_seq=16, max_seq=1024, max_batch=32)
    for n in range(1, 1025):
        b = p.seq_bucket(n)
        assert b >= n and b in p.seq_buckets
        assert all(c < n for c in p.seq_buckets if c < b)
    assert p.bucket(5, 16, 17) == (8, 16, 32)
    assert p.bucket(1, 100) == (1, 128, 128)  # seq_kv defaults to seq_q


@pytest.mark.parametrize("call, error, match", [
    (lambda p: p.seq_bucket(1025), ValueError, "exceeds the largest bucket 1024"),
    (lambda p: p.batch_bucket(65), ValueError, "batch=65"),
    (lambda p: p.seq_bucket(0), ValueError, "seq_kv must be >= 1"),
    (lambda p: p.query_bucket(True), TypeError, "seq_q must be an int"),
    (lambda p: BucketPolicy(min_seq=256, max_seq=128), ValueError, "exceeds maximum"),
    (lambda p: BucketPolicy("128"), TypeError, "seq_buckets"),
    (lambda p: BucketPolicy([]), TypeError, "seq_buckets"),
    (lambda p: BucketPolicy(batch_buckets=[0, 4]), ValueError, "batch_buckets"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(BucketPolicy(min_seq=16, max_seq=1024))


def test_random_requests_hit_a_bounded_set_of_keys():
    """500 random request shapes -> at most |batch buckets| * |seq buckets| problem keys."""
    policy = BucketPolicy(min_seq=128, max_seq=2048, max_batch=16)
    rng = random.Random(0)
    raw, keys = set(), set()
    for _ in range(500):
        lens = [rng.randint(1, 2048) for _ in range(rng.randint(1, 16))]
        qs = [torch.empty(4, n, 64, dtype=torch.float16, device="meta") for n in lens]
        padded = pad_to_bucket(policy, qs, qs, qs, mask=ca.Causal("bottom_right"))
        problem = ca.AttnProblem.from_tensors(padded.q, padded.k, padded.v, mask=padded.mask)
        raw.add((len(lens), max(lens)))
        keys.add(problem.plan_key)
        assert policy.bucket(len(lens), max(lens)) == padded.shape
    bound = len(policy.batch_buckets) * len(policy.seq_buckets)  # q and kv buckets coincide here
    assert bound == 5 * 5
    assert len(keys) <= bound
    assert len(raw) > 10 * len(keys)


def requests(lens_q, lens_kv, H=2, D=8, Dv=None, seed=0, layout="bhsd"):
    g = torch.Generator().manual_seed(seed)

    def rnd(h, n, d):
        shape = (h, n, d) if layout == "bhsd" else (n, h, d)
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return ([rnd(H, n, D) for n in lens_q], [rnd(H, n, D) for n in lens_kv],
            [rnd(H, n, Dv or D) for n in lens_kv])


MASKS = {
    "none": None,
    "causal": ca.Causal(),
    "causal_br": ca.Causal("bottom_right"),
    "window_br": ca.SlidingWindow(3, 1, alignment="bottom_right"),
    "window": ca.SlidingWindow(2, 2),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_padding_preserves_results(mask, layout):
    """Bucketed padded call == each request alone (torch engine) == the float64 oracle."""
    lens_q, lens_kv = (5, 1, 13), (9, 4, 13)
    qs, ks, vs = requests(lens_q, lens_kv, layout=layout, Dv=12)
    policy = BucketPolicy(min_seq=8, max_seq=64, max_batch=8)
    padded = pad_to_bucket(policy, qs, ks, vs, mask=MASKS[mask], layout=layout)
    assert padded.shape == (4, 16, 16)
    assert padded.seq_lens_q == (5, 1, 13, 1) and padded.seq_lens_kv == (9, 4, 13, 1)
    out, lse = ca.attention(padded.q, padded.k, padded.v, mask=padded.mask, layout=layout,
                            return_lse=True, backend="torch")
    assert torch.isfinite(out).all()
    for b, o in enumerate(padded.unpad(out)):
        q, k, v = qs[b][None], ks[b][None], vs[b][None]
        alone = ca.attention(q, k, v, mask=MASKS[mask], layout=layout, backend="torch")[0]
        torch.testing.assert_close(o, alone, atol=1e-12, rtol=1e-12)
        lse_alone = ca.attention(q, k, v, mask=MASKS[mask], layout=layout, return_lse=True,
                                 backend="torch")[1][0]
        torch.testing.assert_close(lse[b, :, :lens_q[b]], lse_alone, atol=1e-12, rtol=1e-12)
        visible = oracle.build_visibility(1, lens_q[b], lens_kv[b], **mask_spec(mask))
        ref, ref_lse = oracle.reference_attention(q, k, v, visible, layout=layout)
        torch.testing.assert_close(o, ref[0], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse[b, :, :lens_q[b]], ref_lse[0], atol=1e-10, rtol=1e-10)


def mask_spec(name):
    return {"none": {}, "causal": {"causal": "top_left"},
            "causal_br": {"causal": "bottom_right"},
            "window_br": {"window": (3, 1, "bottom_right")}, "window": {"window": (2, 2)}}[name]


def test_padding_preserves_gradients():
    lens = (3, 7)
    qs, ks, vs = requests(lens, lens, seed=1)
    for t in qs + ks + vs:
        t.requires_grad_(True)
    padded = pad_to_bucket(BucketPolicy(min_seq=4, max_seq=16, max_batch=4), qs, ks, vs,
                           mask=ca.Causal())
    out = ca.attention(padded.q, padded.k, padded.v, mask=padded.mask, backend="torch")
    douts = [torch.randn_like(o) for o in padded.unpad(out)]
    torch.autograd.backward(padded.unpad(out), douts)
    for b in range(2):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (qs[b], ks[b], vs[b]))
        alone = ca.attention(q[None], k[None], v[None], mask=ca.Causal(), backend="torch")[0]
        alone.backward(douts[b])
        for got, want in ((qs[b].grad, q.grad), (ks[b].grad, k.grad), (vs[b].grad, v.grad)):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_4d_batch_with_lengths():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 20, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3, 2, 24, 8, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 24, 8, generator=g, dtype=torch.float64)
    lens_q, lens_kv = torch.tensor([20, 3, 11]), [24, 5, 0]
    padded = pad_to_bucket(BucketPolicy(min_seq=8, max_seq=32, batch_buckets=[4]), q, k, v,
                           seq_lens_q=lens_q, seq_lens_kv=lens_kv)
    assert padded.shape == (4, 32, 32)
    assert padded.seq_lens_q == (20, 3, 11, 1)
    assert padded.seq_lens_kv == (24, 5, 0, 1)
    out = ca.attention(padded.q, padded.k, padded.v, mask=padded.mask, backend="torch")
    ref = ca.attention(q, k, v, mask=ca.Padding(lens_q, lens_kv), backend="torch")
    for b, o in enumerate(padded.unpad(out)):
        torch.testing.assert_close(o, ref[b, :, :int(lens_q[b])], atol=1e-12, rtol=1e-12)
    assert (padded.unpad(out)[2] == 0).all()  # no visible key: zeros, as the contract says


def test_pad_to_bucket_errors():
    p = BucketPolicy(min_seq=8, max_seq=32)
    qs, ks, vs = requests((3, 4), (3, 4))
    with pytest.raises(ValueError, match="Padding"):
        pad_to_bucket(p, qs, ks, vs, mask=ca.Padding((3, 4)))
    with pytest.raises(TypeError, match="mask"):
        pad_to_bucket(p, qs, ks, vs, mask="causal")
    with pytest.raises(ValueError, match="same number of requests"):
        pad_to_bucket(p, qs, ks[:1], vs[:1])
    with pytest.raises(ValueError, match="go with 4-D"):
        pad_to_bucket(p, qs, ks, vs, seq_lens_q=[3, 4])
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        big = requests((40,), (40,))
        pad_to_bucket(p, *big)
    with pytest.raises(ValueError, match="layout"):
        pad_to_bucket(p, qs, ks, vs, layout="sbhd")
    with pytest.raises(TypeError, match="q must be"):
        pad_to_bucket(p, [], ks, vs)
    q4 = torch.zeros(2, 2, 8, 4)
    with pytest.raises(ValueError, match="beyond the sequence dimension"):
        pad_to_bucket(p, q4, q4, q4, seq_lens_q=[9, 1])
    with pytest.raises(ValueError, match="one entry per batch"):
        pad_to_bucket(p, q4, q4, q4, seq_lens_kv=[1])
