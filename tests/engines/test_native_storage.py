"""Varlen and KV-cache calls on the cuDNN engine's own storage paths, run on this CPU through the
stand-in executor of ``cudnn_fake`` (what cuDNN documents for ragged offsets and page tables):

* ``attention_varlen`` runs cuDNN's ragged (THD) graph on the packed tensors as they lie: no
  padding, no host reads of ``cu_seqlens``; forward, lse and gradients against the float64 oracle
  on each sequence alone; one graph serves every batch of lengths whose maxima share a bucket.
* ``attention_with_kvcache`` runs cuDNN's page-table graph over the page pools (no gathering) and
  the dense graph over the whole cache, with ``cache_seqlens`` on the device; decode steps with new
  lengths reuse the graph.
* Lengths, offsets and block tables are never read on the host: they arrive as a tensor type that
  raises on any host read, and the "device" role is played by CPU tensors (``Padding`` is told so).
* Declines name cuDNN's reasons; ``backend="auto"`` falls back to dense batches.
"""

from __future__ import annotations

import pytest
import torch
from test_varlen import cu, oracle_varlen, pack

import cudnn_attn as ca
import cudnn_fake
from cudnn_attn.graphs import _runtime
from cudnn_attn.core import dispatch
from cudnn_attn.model import masks
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.errors import NotSupportedError
from cudnn_attn.packed.calls import varlen_problem
from cudnn_attn.varlen import attention_varlen, attention_with_kvcache

F16, F64 = torch.float16, torch.float64
needs_fe = pytest.mark.skipif(not cudnn_fake.frontend_present(), reason="nvidia-cudnn-frontend "
                              "is not installed")
pytestmark = needs_fe


class HostReadError(AssertionError):
    pass


class DeviceOnly(torch.Tensor):
    """A length/offset/table tensor that refuses to be read on the host, as a CUDA tensor must
    not be on a sync-free path. Arithmetic on it stays ``DeviceOnly``; the stand-in executor
    (which plays the GPU) reads it through ``cudnn_fake.host``."""

    _FORBIDDEN = {"tolist", "item", "__int__", "__index__", "__bool__", "__float__", "numpy",
                  "__iter__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls._FORBIDDEN:
            raise HostReadError(f"{func.__name__} read a device-only tensor on the host")
        return super().__torch_function__(func, types, args, kwargs or {})


def device_only(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceOnly)


@pytest.fixture
def fake(monkeypatch):
    """The fake cuDNN engine, with CPU length tensors kept on the "device" (runtime values)."""
    from cudnn_attn.packed import calls

    monkeypatch.setattr(masks, "_runtime_lengths", lambda value: isinstance(value, torch.Tensor))
    monkeypatch.setattr(calls, "on_accelerator", lambda t: isinstance(t, torch.Tensor))
    yield cudnn_fake.install(monkeypatch)
    clear_caches()


def _graphs_built(fake_state):
    return len(fake_state[1])


# ---------------------------------------------------------------------------------------------
# varlen: cuDNN's ragged layout
# ---------------------------------------------------------------------------------------------

VARLEN_CASES = [
    dict(id="plain"),
    dict(id="causal-tl", mask=dict(causal="top_left")),
    dict(id="causal-br", mask=dict(causal="bottom_right")),
    dict(id="window-br", mask=dict(window=(4, 0, "bottom_right"))),
    dict(id="alibi-causal", alibi=True, mask=dict(causal="top_left")),
    dict(id="causal-negative-scale", mask=dict(causal="top_left"), scale=-0.3),  # issue 36
]
LENS = [((1, 2, 37), (1, 2, 37)), ((5, 0, 9, 3), (7, 4, 0, 12)), ((1, 1, 1), (20, 3, 9))]


def _lib_mask(mask_kw):
    causal, window = mask_kw.get("causal"), mask_kw.get("window")
    mask = None if causal is None else ca.Causal(causal)
    if window is not None:
        w = ca.SlidingWindow(*window)
        mask = w if mask is None else mask & w
    return mask


def _varlen_inputs(lens_q, lens_k, Hq=4, Hkv=2, D=16, Dv=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = pack(lens_q, Hq, D, F16, g), pack(lens_k, Hkv, D, F16, g), pack(lens_k, Hkv, Dv, F16, g)
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("lens", LENS, ids=["same", "empty-seqs", "decode-like"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c["id"] for c in VARLEN_CASES])
def test_varlen_runs_the_ragged_graph_and_matches_the_oracle(case, lens, fake):
    lens_q, lens_k = lens
    Hq = 4
    q, k, v = _varlen_inputs(lens_q, lens_k, Hq=Hq, grad=True)
    mask_kw = case.get("mask", {})
    bias = ca.Alibi() if case.get("alibi") else None
    cu_q, cu_k = device_only(cu(lens_q)), device_only(cu(lens_k))
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                mask=_lib_mask(mask_kw), bias=bias, return_lse=True,
                                scale=case.get("scale"), backend="cudnn")
    out, lse = cudnn_fake.host(out), cudnn_fake.host(lse)  # results may carry the length type
    specs = [spec for spec, _ in fake[1]]
    assert specs and all(spec.ragged for spec in specs), "the ragged graph did not run"
    slopes = None
    if bias is not None:
        import oracle
        slopes = oracle.default_alibi_slopes(Hq)
    ref_inputs = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    scale_kw = {"scale": case["scale"]} if "scale" in case else {}
    ref_out, ref_lse = oracle_varlen(*ref_inputs, lens_q, lens_k, slopes=slopes, **mask_kw,
                                     **scale_kw)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.to(F64), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-4, rtol=1e-4)  # -inf rows too
    # Gradients through out and lse (the lse's reaches q and k through the dlse fold).
    g = torch.Generator().manual_seed(3)
    g_out = torch.randn(ref_out.shape, generator=g, dtype=F64)
    g_lse = torch.randn(ref_lse.shape, generator=g, dtype=F64)

    def loss(o, l_):
        return (o.to(F64) * g_out).sum() + (l_.to(F64).masked_fill(l_.isinf(), 0) * g_lse).sum()

    got = torch.autograd.grad(loss(out, lse), [q, k, v])
    expected = torch.autograd.grad(loss(ref_out, ref_lse), ref_inputs)
    assert any(backward for _, backward in fake[1]), "the ragged backward graph did not run"
    for name, a, e in zip("qkv", got, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a.to(F64), e, atol=2e-2, rtol=2e-2,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_one_ragged_graph_serves_every_batch_of_lengths_in_a_bucket(fake):
    for lens_q, lens_k in (((30, 2, 9), (30, 2, 9)), ((1, 60, 4), (3, 64, 4)), ((0, 0, 33), (5, 5, 40))):
        q, k, v = _varlen_inputs(lens_q, lens_k)
        out = attention_varlen(q, k, v, device_only(cu(lens_q)), device_only(cu(lens_k)),
                               max(lens_q), max(lens_k), mask=ca.Causal("bottom_right"),
                               backend="cudnn")
        out = cudnn_fake.host(out)
        ref, _ = oracle_varlen(q.to(F64), k.to(F64), v.to(F64), lens_q, lens_k,
                               causal="bottom_right")
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert _graphs_built(fake) == 1  # maxima 33..64 share the bucket 64: one forward graph
    (spec, _), = fake[1]
    assert spec.seq_q == spec.seq_kv == 64


@pytest.mark.parametrize("cu_q, match", [((), "B \\+ 1 >= 2"), ((2, 3, 0), "same batch")],
                         ids=["cu-short", "cu-batch"])
def test_device_offsets_are_refused_as_host_ones_are(cu_q, match, fake):
    """Offsets that stay on the device are checked by what their shapes tell, with the host
    route's messages (the device route named the wrong rule: "one entry per batch")."""
    q, k, v = _varlen_inputs((2, 3), (2, 3))
    with pytest.raises(ValueError, match=match):
        attention_varlen(q, k, v, device_only(cu(cu_q)), device_only(cu((2, 3))), 3, 3,
                         backend="cudnn")


def test_a_generous_max_seqlen_plans_nothing_no_engine_runs_packed(fake, monkeypatch):
    """A float32 varlen call with device offsets and max_seqlen 2**20: cuDNN takes no float32,
    so the call goes to the dense-batch path, which pads to the longest sequence. The torch
    engine's plan of the packed problem (a padded batch of the bucketed bounds, its tiles over
    2**20 x 2**20) was built first and then dropped: seconds and gigabytes for nothing."""
    from cudnn_attn.torch_engine import ragged

    def refuse(*args, **kwargs):
        raise AssertionError("the packed problem was planned on the torch engine")

    monkeypatch.setattr(ragged.RaggedPlan, "__init__", refuse)
    q, k, v = (t.float() for t in _varlen_inputs((3, 5), (3, 5)))
    # offsets the native route leaves unread ("device" ones here); the dense path reads them
    out = attention_varlen(q, k, v, cu((3, 5)), cu((3, 5)), 2 ** 20, 2 ** 20)
    ref, _ = oracle_varlen(q.to(F64), k.to(F64), v.to(F64), (3, 5), (3, 5))
    torch.testing.assert_close(out.to(F64), ref, atol=1e-5, rtol=1e-5)


def test_varlen_dropout_seed_reaches_the_ragged_backward(fake):
    q, k, v = _varlen_inputs((6, 9), (6, 9), grad=True)
    gen = torch.Generator().manual_seed(4)
    out = attention_varlen(q, k, v, device_only(cu((6, 9))), device_only(cu((6, 9))), 9, 9,
                           dropout_p=0.25, generator=gen, backend="cudnn")
    out.float().sum().backward()
    graphs = [fake[0].get_or_build(key, None) for key in fake[0].keys()]
    forward, backward = sorted(graphs, key=lambda graph: graph.backward)
    assert forward.seeds and forward.seeds == backward.seeds


# ---------------------------------------------------------------------------------------------
# KV cache: page tables and the whole dense cache
# ---------------------------------------------------------------------------------------------

def _paged_cache(lens, page, Hkv, D, seed, poison=True, pages=None):
    """A shuffled page pool holding each sequence's first ``lens[b]`` tokens, NaN elsewhere,
    the ``[B, pages]`` block table and the dense ``[B, S, H, D]`` copy (zeros past the
    lengths)."""
    g = torch.Generator().manual_seed(seed)
    B, pages = len(lens), pages or max(1, -(-max(lens) // page)) + 1
    num_blocks = B * pages + 3
    order = torch.randperm(num_blocks, generator=g)
    table = order[:B * pages].view(B, pages).to(torch.int32)
    fill = float("nan") if poison else 0.0
    k_pool = torch.full((num_blocks, page, Hkv, D), fill, dtype=F16)
    v_pool = torch.full((num_blocks, page, Hkv, D), fill, dtype=F16)
    dense_k = torch.zeros(B, pages * page, Hkv, D, dtype=F16)
    dense_v = torch.zeros(B, pages * page, Hkv, D, dtype=F16)
    for b, n in enumerate(lens):
        dense_k[b, :n] = torch.randn(n, Hkv, D, generator=g).to(F16)
        dense_v[b, :n] = torch.randn(n, Hkv, D, generator=g).to(F16)
        for t in range(n):
            page_id = table[b, t // page]
            k_pool[page_id, t % page] = dense_k[b, t]
            v_pool[page_id, t % page] = dense_v[b, t]
    for b, n in enumerate(lens):  # entries past a sequence's pages may hold anything
        table[b, -(-n // page):] = -7
    return k_pool, v_pool, table, dense_k, dense_v


def _kvcache_oracle(q, dense_k, dense_v, lens, causal):
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, lse = oracle_varlen(q[b].to(F64), dense_k[b, :n].to(F64), dense_v[b, :n].to(F64),
                               [q.shape[1]], [n], causal=causal)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_paged_cache_runs_cudnn_page_tables_without_gathering(causal, fake):
    page, Hq, Hkv, D = 16, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    for step, lens in enumerate(([40, 1, 17, 0], [41, 2, 18, 1], [57, 33, 3, 16])):
        # One pool and capacity (4 pages a sequence) for every step: one graph serves them all.
        k_pool, v_pool, table, dense_k, dense_v = _paged_cache(lens, page, Hkv, D, seed=step,
                                                               pages=4)
        q = torch.randn(len(lens), 2, Hq, D, generator=g).to(F16)
        out, lse = attention_with_kvcache(
            q, k_pool, v_pool, device_only(torch.tensor(lens, dtype=torch.int32)),
            block_table=device_only(table), mask=None if causal is None else ca.Causal(causal),
            return_lse=True, backend="cudnn")
        out, lse = cudnn_fake.host(out), cudnn_fake.host(lse)
        ref_out, ref_lse = _kvcache_oracle(q, dense_k, dense_v, lens, causal)
        assert not out.isnan().any()
        torch.testing.assert_close(out.to(F64), ref_out, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-4, rtol=1e-4)
    assert _graphs_built(fake) == 1
    (spec, backward), = fake[1]
    assert spec.paged is not None and spec.paged.page_size == page and not backward


def test_dense_cache_reads_the_whole_cache_with_device_lengths(fake):
    Hq, Hkv, D = 4, 4, 16  # decode with causal and GQA is declined (cuDNN 9.18.1 notes)
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(3, 48, Hkv, D, generator=g).to(F16)
    v_cache = torch.randn(3, 48, Hkv, D, generator=g).to(F16)
    for lens in ([48, 5, 0], [1, 30, 47]):
        q = torch.randn(3, 1, Hq, D, generator=g).to(F16)
        out = attention_with_kvcache(q, k_cache, v_cache,
                                     device_only(torch.tensor(lens, dtype=torch.int32)),
                                     mask=ca.Causal("bottom_right"), backend="cudnn")
        out = cudnn_fake.host(out)
        ref, _ = _kvcache_oracle(q, k_cache, v_cache, lens, "bottom_right")
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert _graphs_built(fake) == 1
    assert fake[1][0][0].seq_kv == 48  # the whole cache, not the longest length


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_one_device_length_for_every_sequence_runs_the_native_graph(paged, fake):
    """``cache_seqlens`` as a 0-d device tensor (documented: one length for every sequence)
    took the native route and was refused there as not 1-D (a GPU call raised ValueError where
    the CPU's read it); it now serves every sequence, never read on the host."""
    lens, page, Hkv, D = [21, 21, 21], 16, 2, 16
    k_pool, v_pool, table, dense_k, dense_v = _paged_cache(lens, page, Hkv, D, seed=4, pages=3)
    q = torch.randn(3, 1, 4, D, generator=torch.Generator().manual_seed(5)).to(F16)
    caches = (k_pool, v_pool) if paged else (dense_k, dense_v)
    out = attention_with_kvcache(q, *caches, device_only(torch.tensor(21, dtype=torch.int32)),
                                 block_table=device_only(table) if paged else None,
                                 backend="cudnn")
    ref, _ = _kvcache_oracle(q, dense_k, dense_v, lens, None)
    torch.testing.assert_close(cudnn_fake.host(out).to(F64), ref, atol=2e-3, rtol=2e-3)
    assert _graphs_built(fake) == 1


def test_a_page_size_cudnn_refuses_is_declined_with_its_reason(fake):
    lens, page = [7, 3], 5
    k_pool, v_pool, table, dense_k, dense_v = _paged_cache(lens, page, 2, 16, seed=0, poison=False)
    q = torch.randn(2, 1, 2, 16).to(F16)
    with pytest.raises(NotSupportedError, match="page size must be a power of two"):
        attention_with_kvcache(q, k_pool, v_pool, torch.tensor(lens), block_table=table,
                               backend="cudnn")
    # "auto" on this CPU takes the dense-batch path, with the same result as the oracle.
    table[table < 0] = 0
    out = attention_with_kvcache(q, k_pool, v_pool, torch.tensor(lens), block_table=table)
    ref, _ = _kvcache_oracle(q, dense_k, dense_v, lens, None)
    torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)


def test_ragged_problems_are_declined_by_engines_that_address_dense_batches():
    q = torch.randn(10, 2, 16, dtype=F16)
    problem = varlen_problem(q, q, q, cu((4, 6)), cu((4, 6)), 6, 6, read=False)
    verdicts = dispatch.verdicts(problem)
    assert any("dense batches" in r for r in verdicts["cupy"])
    # the torch engine runs them as their padded batch (tests/engines/test_torch_ragged.py)
    assert verdicts["torch"] in ([], "selected")


def test_device_only_tensors_do_refuse_host_reads():
    t = device_only(torch.tensor([1, 2]))
    for read in (t.tolist, lambda: int(t[0]), lambda: bool(t[0] > 0)):
        with pytest.raises(HostReadError):
            read()


# ---------------------------------------------------------------------------------------------
# FlashAttention's varlen API on the same graph
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("same_cu", [True, False], ids=["self", "cross"])
@pytest.mark.parametrize("route", ["mha", "plain"])
def test_flash_attn_varlen_func_runs_the_ragged_graph(causal, same_cu, route, fake, monkeypatch):
    """Both routes of ``flash_attn_varlen_func`` run the ragged graphs, forward and backward:
    the mha_* route (asked for the lse) plans the backward's problem again, with offsets of its
    own; the plain route (``attention_varlen``'s) binds the forward's in the backward."""
    from cudnn_attn.compat.flash_attn import native
    from cudnn_attn.flash_attn_interface import flash_attn_varlen_func

    # This CPU plays the accelerator for the route decision too.
    monkeypatch.setattr(native, "takes", lambda q, paged, slopes, probs, p_dropout=0.0: not paged
                        and slopes is None and (not probs or p_dropout > 0))
    offsets_made = []
    ragged_offsets = _runtime.ragged_offsets_of
    monkeypatch.setattr(_runtime, "ragged_offsets_of",
                        lambda *a: offsets_made.append(a) or ragged_offsets(*a))
    lens_q = (9, 1, 0, 30)
    lens_k = lens_q if same_cu else (4, 12, 3, 30)
    q, k, v = _varlen_inputs(lens_q, lens_k, Hq=4, Hkv=2, D=16, Dv=16, grad=True)
    cu_q = device_only(cu(lens_q))
    cu_k = cu_q if same_cu else device_only(cu(lens_k))
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                 return_attn_probs=route == "mha")
    out = cudnn_fake.host(got[0] if route == "mha" else got)
    assert fake[1] and all(spec.ragged for spec, _ in fake[1])
    mask_kw = dict(causal="bottom_right") if causal else {}
    ref_inputs = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = oracle_varlen(*ref_inputs, lens_q, lens_k, **mask_kw)
    torch.testing.assert_close(out.to(F64), ref_out, atol=2e-3, rtol=2e-3)
    if route == "mha":
        torch.testing.assert_close(cudnn_fake.host(got[1]).to(F64), ref_lse, atol=1e-4,
                                   rtol=1e-4)
    g_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    got = torch.autograd.grad((out.to(F64) * g_out).sum(), [q, k, v])
    expected = torch.autograd.grad((ref_out * g_out).sum(), ref_inputs)
    assert [backward for _, backward in fake[1]] == [False, True]
    assert len(offsets_made) == (2 if route == "mha" else 1)
    for name, a, e in zip("qkv", got, expected):
        torch.testing.assert_close(a.to(F64), e, atol=2e-2, rtol=2e-2,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "dense"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "half"])
def test_flash_attn_with_kvcache_appends_rotates_and_attends_on_the_device(paged, rotary, fake,
                                                                            monkeypatch):
    """One decode step through the device route (cuDNN's graph, lengths and tables never read):
    out and lse against a float64 oracle (rotary by FlashAttention's published formula, then
    causal attention over each sequence's ``n + S_new`` tokens), and the same caches and
    results as the dense-batch route FlashAttention's own test file checks."""
    from cudnn_attn.compat.flash_attn import native
    from cudnn_attn.flash_attn_interface import flash_attn_with_kvcache

    B, Hq, Hkv, D, page, pages, s_new = 3, 4, 4, 16, 16, 4, 2
    lens = [5, 0, 40]
    g = torch.Generator().manual_seed(8)
    if paged:
        k_pool, v_pool, table, dense_k, dense_v = _paged_cache(lens, page, Hkv, D, seed=3,
                                                               poison=False, pages=pages)
        table[table < 0] = torch.arange(B * pages, B * pages + 3)[0]  # spare pages, unused
    else:
        k_pool = torch.randn(B, pages * page, Hkv, D, generator=g).to(F16)
        v_pool = torch.randn(B, pages * page, Hkv, D, generator=g).to(F16)
        dense_k, dense_v, table = k_pool, v_pool, None
    q = torch.randn(B, s_new, Hq, D, generator=g).to(F16)
    k_new = torch.randn(B, s_new, Hkv, D, generator=g).to(F16)
    v_new = torch.randn(B, s_new, Hkv, D, generator=g).to(F16)
    kw = dict(causal=True, return_softmax_lse=True)
    if rotary is not None:
        angles = torch.rand(pages * page, D // 4, generator=g) * 6
        kw.update(rotary_cos=angles.cos().to(F16), rotary_sin=angles.sin().to(F16),
                  rotary_interleaved=rotary == "interleaved")

    def step(device_route):
        monkeypatch.setattr(native, "takes_kvcache",
                            lambda *args: device_route and args[2] is None and args[3] is None)
        kc, vc = k_pool.clone(), v_pool.clone()
        lens_t = torch.tensor(lens, dtype=torch.int32)
        out, lse = flash_attn_with_kvcache(
            q, kc, vc, k_new, v_new, cache_seqlens=device_only(lens_t) if device_route else lens_t,
            block_table=None if table is None else (device_only(table) if device_route else table),
            **kw)
        return cudnn_fake.host(out), cudnn_fake.host(lse), kc, vc

    built_before = _graphs_built(fake)
    out, lse, kc, vc = step(True)
    assert _graphs_built(fake) == built_before + 1, "the device route did not run cuDNN's graph"
    assert (fake[1][-1][0].paged is not None) == paged
    ref_out, ref_lse, ref_kc, ref_vc = step(False)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    torch.testing.assert_close(out.to(F64), ref_out.to(F64), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.to(F64), ref_lse.to(F64), atol=1e-4, rtol=1e-4)

    for b, n in enumerate(lens):  # the float64 oracle (the cache keeps rotated k in fp16)
        positions = torch.arange(n, n + s_new)
        q_b, k_b = q[b].to(F64), k_new[b].to(F64)
        if rotary is not None:
            q_b, k_b = (_rotate(x, kw["rotary_cos"], kw["rotary_sin"], positions,
                                rotary == "interleaved") for x in (q_b, k_b))
        keys = torch.cat([dense_k[b, :n].to(F64), k_b])
        values = torch.cat([dense_v[b, :n].to(F64), v_new[b].to(F64)])
        o_b, lse_b = oracle_varlen(q_b, keys, values, [s_new], [n + s_new], causal="bottom_right")
        torch.testing.assert_close(out[b].to(F64), o_b, atol=5e-3, rtol=5e-3)
        torch.testing.assert_close(lse[b].to(F64), lse_b, atol=5e-3, rtol=5e-3)


def _rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding, FlashAttention's formula: pairs ``(a, b)`` of the first ``2 * cos.shape[1]``
    features become ``(a cos - b sin, a sin + b cos)``; interleaved pairs ``(0, 1), (2, 3)``,
    else ``(i, i + r / 2)``. ``x`` ``[S, H, D]`` float64, ``positions`` ``[S]``."""
    r = 2 * cos.shape[1]
    c, s = (t.to(F64)[positions][:, None, :] for t in (cos, sin))
    head, tail = x[..., :r], x[..., r:]
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        turned = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = head[..., :r // 2], head[..., r // 2:]
        turned = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([turned, tail], dim=-1)


# ---------------------------------------------------------------------------------------------
# The cuDNN builder's paged containers
# ---------------------------------------------------------------------------------------------

def test_builder_reads_cudnn_paged_containers_through_the_tables(fake, monkeypatch):
    """``set_paged_attention_k/v_table`` on the device route: cuDNN's [num_blocks, H, page, D]
    containers bound as they lie (different K and V tables), against the builder's dense call."""
    from cudnn_attn.packed import calls

    g = torch.Generator().manual_seed(6)
    B, H, D, page, pages = 2, 2, 16, 4, 3
    q = torch.randn(B, H, 2, D, generator=g).to(F16)
    k, v = (torch.randn(B, H, pages * page, D, generator=g).to(F16) for _ in range(2))
    containers, tables = [], []
    for dense in (k, v):  # each with its own page order
        order = torch.randperm(B * pages, generator=g)
        blocks = torch.empty(B * pages, H, page, D, dtype=F16)
        blocks[order] = dense.view(B, H, pages, page, D).permute(0, 2, 1, 3, 4).reshape(-1, H, page, D)
        containers.append(blocks)
        tables.append(order.view(B, pages).to(torch.int32))
    lens_kv = [9, 12]

    def attrs(paged):
        a = (ca.SdpaAttributes().set_attn_scale(0.4).set_padding_mask(True)
             .set_seq_len_q([2, 2]).set_seq_len_kv(lens_kv))
        if paged:
            a = a.set_paged_attention_k_table(tables[0][:, None, :, None]) \
                .set_paged_attention_v_table(tables[1])
        return a

    monkeypatch.setattr(calls, "on_accelerator", lambda t: True)  # this CPU plays it
    out, stats = ca.scaled_dot_product_flash_attention(q, *containers, attrs(True))
    (spec, _), = fake[1]
    assert spec.paged is not None and spec.paged.layout == "bhsd"
    monkeypatch.setattr(calls, "on_accelerator", lambda t: False)
    want, want_stats = ca.scaled_dot_product_flash_attention(q, k, v, attrs(False))
    torch.testing.assert_close(out.to(F64), want.to(F64), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(stats, want_stats, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Padding with runtime (device) lengths on dense batches
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cudnn", "torch"])
def test_runtime_padding_lengths_are_never_read_and_share_one_plan(backend, fake):
    import oracle

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(3, 2, 20, 16, generator=g).to(F16) for _ in range(3))
    for lens_q, lens_k in (([20, 7, 1], [20, 3, 0]), ([5, 20, 13], [9, 20, 20])):
        # The torch engine may read them (on the host it runs anyway); cuDNN must not.
        wrap = device_only if backend == "cudnn" else (lambda t: t)
        mask = ca.Causal("bottom_right") & ca.Padding(wrap(torch.tensor(lens_q)),
                                                      wrap(torch.tensor(lens_k)))
        assert mask.parts()[-1].runtime is not None or mask.parts()[0].runtime is not None
        out, lse = ca.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
        out, lse = cudnn_fake.host(out), cudnn_fake.host(lse)
        vis = oracle.build_visibility(3, 20, 20, causal="bottom_right", seq_lens_q=lens_q,
                                      seq_lens_kv=lens_k)
        ref, ref_lse = oracle.reference_attention(q.to(F64), k.to(F64), v.to(F64), vis)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-3, rtol=1e-3)
    if backend == "cudnn":
        assert _graphs_built(fake) == 1 and fake[1][0][0].padding


def test_builder_lengths_on_the_device_are_runtime_values(fake, monkeypatch):
    """``set_seq_len_q/kv`` and ``set_cu_seq_len_q/kv`` with device tensors: never read on the
    host (cuDNN's seq_len tensors are graph inputs); same results, forward and backward, as the
    same lengths given as ints."""
    from cudnn_attn.packed import calls

    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(3, 2, 24, 16, generator=g).to(F16) for _ in range(3))
    d_o = torch.randn(3, 2, 24, 16, generator=g).to(F16)

    def run(lens_q, lens_kv, wrap, cumulative):
        fwd, bwd = ca.SdpaAttributes(), ca.SdpaBackwardAttributes()
        for attrs in (fwd, bwd):
            attrs.set_causal_mask(True).set_padding_mask(True).set_attn_scale(0.3)
            if cumulative:
                attrs.set_cu_seq_len_q(wrap(cu(lens_q))).set_cu_seq_len_kv(wrap(cu(lens_kv)))
            else:
                attrs.set_seq_len_q(wrap(torch.tensor(lens_q))) \
                    .set_seq_len_kv(wrap(torch.tensor(lens_kv)))
        fwd.set_generate_stats(True)
        o, stats = ca.scaled_dot_product_flash_attention(q, k, v, fwd)
        grads = ca.scaled_dot_product_flash_attention_backward(q, k, v, o, d_o, stats, bwd)
        return [cudnn_fake.host(t) for t in (o, stats, *grads)]

    for cumulative in (False, True):
        for lens in (([24, 5, 1], [24, 9, 3]), ([2, 24, 17], [7, 24, 20])):
            monkeypatch.setattr(calls, "on_accelerator", lambda t: True)
            monkeypatch.setattr(masks, "_runtime_lengths",
                                lambda value: isinstance(value, torch.Tensor))
            got = run(*lens, device_only, cumulative)
            monkeypatch.undo()
            cudnn_fake.install(monkeypatch)
            want = run(*lens, lambda t: t, cumulative)
            for name, a, b in zip(("o", "stats", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# The cuDNN builder's packed (THD) calls
# ---------------------------------------------------------------------------------------------

def _packed_builder(lens_q, lens_k, cumulative_tensor, causal, alibi, dtype):
    fwd, bwd = ca.SdpaAttributes().set_generate_stats(True), ca.SdpaBackwardAttributes()
    for attrs in (fwd, bwd):
        attrs.set_padding_mask(True).set_attn_scale(0.25)
        attrs.set_cu_seq_len_q(cumulative_tensor(cu(lens_q))) \
            .set_cu_seq_len_kv(cumulative_tensor(cu(lens_k)))
        if causal:
            attrs.set_causal_mask(True)
        if alibi:
            attrs.set_alibi_mask(True)
    return fwd, bwd


@pytest.mark.parametrize("causal, alibi", [(False, False), (True, False), (True, True)])
def test_builder_packed_calls_match_the_oracle_on_every_engine(causal, alibi, fake, monkeypatch):
    """``[total, H, D]`` tensors with ``set_cu_seq_len_q/kv``: on this CPU through
    ``attention_varlen`` (float64, against the oracle on each sequence), and on the cuDNN route
    through its ragged graph (fp16, offsets never read on the host) with the same results."""
    import oracle

    from cudnn_attn.packed import calls

    lens_q, lens_k = (5, 1, 0, 9), (5, 7, 3, 9)
    g = torch.Generator().manual_seed(11)
    q, k, v = pack(lens_q, 4, 16, F64, g), pack(lens_k, 2, 16, F64, g), pack(lens_k, 2, 16, F64, g)
    d_o = torch.randn(q.shape, generator=g, dtype=F64)
    slopes = oracle.default_alibi_slopes(4) if alibi else None

    def run(dtype, wrap):
        fwd, bwd = _packed_builder(lens_q, lens_k, wrap, causal, alibi, dtype)
        args = [t.to(dtype) for t in (q, k, v)]
        o, stats = ca.scaled_dot_product_flash_attention(*args, fwd)
        grads = ca.scaled_dot_product_flash_attention_backward(*args, o, d_o.to(dtype), stats, bwd)
        return [cudnn_fake.host(t) for t in (o, stats, *grads)]

    monkeypatch.setattr(calls, "on_accelerator", lambda t: False)
    o, stats, *grads = run(F64, lambda t: t)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_o, ref_lse = oracle_varlen(*ref_in, lens_q, lens_k, slopes=slopes, scale=0.25,
                                   **({"causal": "top_left"} if causal else {}))
    assert stats.shape == (sum(lens_q), 4, 1)
    torch.testing.assert_close(o, ref_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(stats[..., 0].t(), ref_lse, atol=1e-10, rtol=1e-10)
    for a, e in zip(grads, torch.autograd.grad(ref_o, ref_in, d_o)):
        torch.testing.assert_close(a, e, atol=1e-9, rtol=1e-9)

    monkeypatch.setattr(calls, "on_accelerator", lambda t: True)
    got = run(F16, device_only)
    assert {spec.ragged for spec, _ in fake[1]} == {True} and len(fake[1]) == 2
    for name, a, e in zip(("o", "stats", "dq", "dk", "dv"), got, (o, stats, *grads)):
        torch.testing.assert_close(a.to(F64), e, atol=3e-2, rtol=3e-2,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_cpu_lengths_are_still_checked_on_the_device_route():
    """Reading CPU lengths is free: a malformed one is a ValueError naming it, also when cuDNN
    is forced (which then declines the call on this machine)."""
    q = torch.randn(10, 2, 16, dtype=F16)
    bad = torch.tensor([0, 6, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention_varlen(q, q, q, bad, cu((4, 2, 4)), 6, 6, backend="cudnn")
    k_cache = torch.randn(2, 8, 2, 16, dtype=F16)
    with pytest.raises(ValueError, match="cache_seqlens"):
        attention_with_kvcache(q[:2, None], k_cache, k_cache, torch.tensor([3, 9]),
                               backend="cudnn")
    with pytest.raises(NotSupportedError, match="cudnn"):
        attention_varlen(q, q, q, cu((4, 6)), cu((4, 6)), 6, 6, backend="cudnn")


def _poisoned(make):
    """``torch.empty``/``empty_like`` whose floating tensors hold NaN: uninitialised memory as a
    GPU may hand it out (the CPU's often reads as zeros)."""
    def poisoned(*args, **kwargs):
        t = make(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return poisoned


def test_packed_tokens_past_the_last_sequence_get_zeros_and_minus_inf(fake, monkeypatch):
    """Tokens of the packed tensors past ``cu_seqlens[-1]`` (a buffer with spare capacity)
    belong to no sequence: cuDNN never writes them, and out, lse and the gradients there read
    0, -inf and 0 whatever the allocator hands out, self-attention offsets (one tensor: out
    and stats made filled) and cross offsets (the flagged rows filled) alike; the sequences'
    tokens match the oracle."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    lens, spare = (5, 0, 9), 3
    total = sum(lens)
    q, k, v = _varlen_inputs(lens + (spare,), lens + (spare,), grad=True)
    offsets = device_only(cu(lens))
    for cu_k in (offsets, device_only(cu(lens))):
        out, lse = attention_varlen(q, k, v, offsets, cu_k, max(lens), max(lens),
                                    mask=ca.Causal(), return_lse=True, backend="cudnn")
        out, lse = cudnn_fake.host(out), cudnn_fake.host(lse)
        assert (out[total:] == 0).all() and (lse[:, total:] == -float("inf")).all()
        ref_inputs = [t.detach()[:total].to(F64).requires_grad_(True) for t in (q, k, v)]
        ref_out, ref_lse = oracle_varlen(*ref_inputs, lens, lens, causal="top_left")
        torch.testing.assert_close(out[:total].to(F64), ref_out, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse[:, :total].to(F64), ref_lse, atol=1e-4, rtol=1e-4)
        g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
        got = torch.autograd.grad((out.to(F64) * g_out).sum(), [q, k, v])
        expected = torch.autograd.grad((ref_out * g_out[:total]).sum(), ref_inputs)
        for name, a, e in zip("qkv", got, expected):
            assert (cudnn_fake.host(a)[total:] == 0).all(), f"d{name} past the end"
            torch.testing.assert_close(cudnn_fake.host(a)[:total].to(F64), e, atol=2e-2,
                                       rtol=2e-2, msg=lambda m, name=name: f"d{name}: {m}")
