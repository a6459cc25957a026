"""The cuDNN engine without a GPU.

* Every supported configuration builds a graph that passes ``pygraph.validate()`` and the
  frontend's C++ validator for sm_90 and sm_80 (``backend_graph(sm_version=...)``, reference §4).
* The graph attributes express the semantics: uids and names, the pass-by-value scale, explicit
  ``generate_stats``, diagonal bounds (checked against a brute-force visibility from the oracle),
  padding, ALiBi, bias/dBias, dropout, determinism, ragged offsets, page tables.
* Every documented rejected combination is declined with a reason (``cudnn_reasons`` and
  ``describe``), and the frontend itself rejects the raw graphs behind the main rules.
* ``CudnnPlan``'s host logic (layouts, empty rows, LSE, the dlse fold, dBias, dropout seeds) runs
  against a stand-in executor that computes what cuDNN documents, compared to the float64 oracle.
* On this machine ``CudnnBackend.supports`` says "no CUDA device" and the dispatcher picks torch.
"""

import importlib.util
import json
import re

import pytest
import torch
from common import Problem
import cudnn_fake
from cudnn_fake import cudnn_visibility

import cudnn_attn as ca
from cudnn_attn.core import dispatch
from cudnn_attn.core.caches import cache_sizes, clear_caches
from cudnn_attn.graphs import _runtime
from cudnn_attn.graphs._runtime import padded_rows
from cudnn_attn.graphs._spec import GraphOptions, PagedKV, analyze
from cudnn_attn.graphs.sdpa import UID, describe, validate_for

needs_fe = pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                              reason="nvidia-cudnn-frontend is not installed")
F16, BF16 = torch.float16, torch.bfloat16


def qkv(B=2, Hq=4, Hkv=None, Sq=128, Skv=None, D=64, Dv=None, dtype=F16, layout="bhsd",
        device="meta"):
    Hkv, Skv, Dv = Hkv or Hq, Skv or Sq, Dv or D

    def t(H, S, d):
        shape = (B, H, S, d) if layout == "bhsd" else (B, S, H, d)
        if device == "meta":
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)

    gen = torch.Generator().manual_seed(B * 1000 + Sq)

    return t(Hq, Sq, D), t(Hkv, Skv, D), t(Hkv, Skv, Dv)


def meta(*shape, dtype=F16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def packed_qkv(B=2, S=128, H=4, D=64):
    """q, k, v as views of one [B, S, 3, H, D] tensor (bshd with a 3*H*D token stride)."""
    qkv_ = torch.empty(B, S, 3, H, D, dtype=F16, device="meta")
    return qkv_[:, :, 0], qkv_[:, :, 1], qkv_[:, :, 2]


# id -> (tensors, attention kwargs, options, directions)
SUPPORTED = {
    "dense": (qkv(), {}, None),
    "dense-bshd-bf16": (qkv(D=128, dtype=BF16, layout="bshd"), {"layout": "bshd"}, None),
    "gqa-8/2": (qkv(Hq=8, Hkv=2), {"mask": ca.Causal()}, None),
    "mqa-8/1": (qkv(Hq=8, Hkv=1), {}, None),
    "dv<dqk": (qkv(D=128, Dv=64), {}, None),
    "d192-dv128": (qkv(D=192, Dv=128), {"mask": ca.Causal()}, None),
    "causal-tl": (qkv(Sq=64, Skv=192), {"mask": ca.Causal()}, None),
    "causal-br": (qkv(Sq=64, Skv=192), {"mask": ca.Causal("bottom_right")}, None),
    "causal-br-square": (qkv(), {"mask": ca.Causal("bottom_right")}, None),
    "window-16-0": (qkv(), {"mask": ca.SlidingWindow(16, 0)}, None),
    "window-8-4": (qkv(Sq=100, Skv=160), {"mask": ca.SlidingWindow(8, 4)}, None),
    "window-left-only": (qkv(), {"mask": ca.SlidingWindow(32, -1)}, None),
    "window-right-only": (qkv(), {"mask": ca.SlidingWindow(-1, 16)}, None),
    "window-br": (qkv(Sq=64, Skv=192), {"mask": ca.SlidingWindow(8, 0, "bottom_right")}, None),
    "causal&window": (qkv(), {"mask": ca.Causal() & ca.SlidingWindow(24, -1)}, None),
    "padding": (qkv(B=3), {"mask": ca.Padding([128, 5, 1], [100, 128, 7])}, None),
    "padding-causal-br-sq>skv": (qkv(Sq=192, Skv=64),
                                 {"mask": ca.Padding([192, 30], [64, 50]) & ca.Causal("bottom_right")},
                                 None),
    "padding-window-br": (qkv(Sq=64, Skv=192),
                          {"mask": ca.Padding([64, 20], [192, 90])
                           & ca.SlidingWindow(16, 0, "bottom_right")}, None),
    "alibi-causal": (qkv(), {"mask": ca.Causal(), "bias": ca.Alibi()}, None),
    "alibi-causal-padding": (qkv(Hq=6), {"mask": ca.Causal() & ca.Padding([100, 128]),
                                         "bias": ca.Alibi()}, None),
    "bias-1hss": (qkv(), {"bias": meta(1, 4, 128, 128)}, None),
    "bias-b11s": (qkv(), {"bias": meta(2, 1, 1, 128)}, None),
    "bias-2d": (qkv(), {"bias": meta(128, 128)}, None),
    "bias-fp32": (qkv(), {"bias": meta(1, 4, 128, 128, dtype=torch.float32)}, None),
    "bias-grad": (qkv(), {"bias": meta(2, 4, 128, 128, grad=True), "mask": ca.Causal()}, None),
    "bias-skv100": (qkv(Sq=96, Skv=100), {"bias": meta(1, 4, 96, 100, grad=True)}, None),
    "dropout": (qkv(), {"dropout_p": 0.1, "mask": ca.Causal()}, None),
    "dropout-mask": (qkv(), {}, GraphOptions(dropout_mask=True)),
    "everything": (qkv(), {"mask": ca.Causal() & ca.Padding([128, 77]), "bias": ca.Alibi(),
                           "dropout_p": 0.2}, None),
    "packed-qkv": (packed_qkv(), {"layout": "bshd", "mask": ca.Causal()}, None),
    "decode-br": (qkv(Sq=1, Skv=300), {"mask": ca.Causal("bottom_right")}, None),
    "deterministic": (qkv(), {"mask": ca.Causal()}, GraphOptions(deterministic=True)),
    "ragged": (qkv(layout="bshd"), {"layout": "bshd", "mask": ca.Padding([100, 3], [128, 60])},
               GraphOptions(ragged=True)),
    "ragged-causal-max": (qkv(layout="bshd"),
                          {"layout": "bshd",
                           "mask": ca.Padding([100, 3], [128, 60]) & ca.Causal("bottom_right")},
                          GraphOptions(ragged=True, max_total_seq_len_q=103, max_total_seq_len_kv=188)),
    "paged": (qkv(Sq=1, Skv=256, Hkv=2, layout="bshd"),
              {"layout": "bshd", "mask": ca.Padding([1, 1], [100, 256])},
              GraphOptions(paged=PagedKV(num_blocks=16, page_size=64))),
}
FORWARD_ONLY = {"paged"}
# Arch limits our rules decline before the frontend is asked (the frontend agrees: see below).
ARCH_DECLINED = {("d192-dv128", "bwd", 80): "serves head dims up to 128",
                 ("ragged", "bwd", 80): "packed LSE",
                 ("ragged-causal-max", "bwd", 80): "packed LSE"}


def _problem(name, backward=False):
    (q, k, v), kwargs, options = SUPPORTED[name]
    p = ca.AttnProblem.from_tensors(q, k, v, **kwargs)
    return p, kwargs, options


def _cases():
    for name in SUPPORTED:
        for direction in ("fwd", "bwd"):
            if direction == "bwd" and name in FORWARD_ONLY:
                continue
            yield pytest.param(name, direction, id=f"{name}-{direction}")


@needs_fe
@pytest.mark.parametrize("name,direction", list(_cases()))
def test_supported_configuration_passes_both_validators(name, direction):
    (q, k, v), kwargs, options = SUPPORTED[name]
    backward = direction == "bwd"
    graph = describe(q, k, v, backward=backward, target_sm=90, options=options, **kwargs)
    graph.validate()  # the Python SDPA validator (again: describe already ran it)
    (node,) = graph.nodes
    assert node.node_type.name == ("SDPA_BWD" if backward else "SDPA")
    problem, _, _ = _problem(name)
    for sm in (90, 80):
        expected = ARCH_DECLINED.get((name, direction, sm))
        if expected is None:
            cpp = validate_for(problem, sm, backward=backward, options=options)
            assert json.loads(str(cpp))["nodes"][0]["tag"] == ("SDPA_BWD" if backward else "SDPA")
        else:
            with pytest.raises(ca.NotSupportedError, match=expected):
                validate_for(problem, sm, backward=backward, options=options)


def _json(name, backward=False, sm=90, **kw):
    problem, _, options = _problem(name)
    if kw:
        (q, k, v), kwargs, options = SUPPORTED[name]
        problem = ca.AttnProblem.from_tensors(q, k, v, **{**kwargs, **kw})
    return json.loads(str(validate_for(problem, sm, backward=backward, options=options)))


def _tensors(j):
    return {t["name"]: t for t in j["tensors"]}


@needs_fe
@pytest.mark.parametrize("name,direction", list(_cases()))
def test_uids_names_and_pass_by_value_scale(name, direction):
    j = _json(name, backward=direction == "bwd")
    node = j["nodes"][0]
    for t in j["tensors"]:
        if t["uid"] in UID._value2member_map_:
            assert t["name"] == UID(t["uid"]).name.lower(), t
    tensors = _tensors(j)
    for port, uid in {"Q": UID.Q, "K": UID.K, "V": UID.V, "Attn_scale": UID.SCALE}.items():
        assert node["inputs"][port] == uid
    # the scale is an input, passed by value: never a float baked into the graph
    assert node.get("attn_scale_value") is None
    assert tensors["scale"]["is_pass_by_value"] and tensors["scale"]["data_type"] == "FLOAT"
    if direction == "bwd":
        assert {node["outputs"][p] for p in ("dQ", "dK", "dV")} == {UID.DQ, UID.DK, UID.DV}
        assert node["inputs"]["Stats"] == UID.STATS and node["inputs"]["dO"] == UID.DO
    else:
        assert node["outputs"]["O"] == UID.O


@needs_fe
def test_scale_stays_out_of_the_graph():
    q, k, v = qkv()
    a = ca.AttnProblem.from_tensors(q, k, v, scale=0.1)
    b = ca.AttnProblem.from_tensors(q, k, v, scale=0.7)
    assert analyze(a)[0] == analyze(b)[0]
    # the backend's own graph hash: it changes with a baked attn_scale float, not with ours
    assert validate_for(a, 90).key() == validate_for(b, 90).key()


@needs_fe
@pytest.mark.parametrize("need", [True, False])
def test_generate_stats_is_always_explicit(need):
    q, k, v = qkv()
    graph = describe(q, k, v, return_lse=need)
    (node,) = graph.nodes
    assert node.params["generate_stats"] is need
    assert ("Stats" in node.outputs and node.outputs["Stats"] is not None) is need


BANDS = [  # (mask, S_q, S_kv, alignment, left_bound, right_bound)
    (ca.Causal(), 128, 128, "TOP_LEFT", None, 0),
    (ca.Causal("bottom_right"), 64, 192, "BOTTOM_RIGHT", None, 0),
    (ca.Causal("bottom_right"), 128, 128, "TOP_LEFT", None, 0),  # same diagonal: normalized
    (ca.SlidingWindow(16, 0), 128, 128, "TOP_LEFT", 17, 0),  # FA left -> left + 1
    (ca.SlidingWindow(8, 4), 100, 160, "TOP_LEFT", 9, 4),
    (ca.SlidingWindow(-1, 16), 128, 128, "TOP_LEFT", None, 16),
    (ca.SlidingWindow(32, -1), 128, 128, "TOP_LEFT", 33, None),
    (ca.Causal() & ca.SlidingWindow(24, 3), 128, 128, "TOP_LEFT", 25, 0),
    (ca.SlidingWindow(8, 0, "bottom_right"), 64, 192, "BOTTOM_RIGHT", 9, 0),
    (ca.SlidingWindow(500, 500), 128, 128, None, None, None),  # hides nothing: no band
    (ca.Causal("bottom_right"), 1, 300, None, None, None),  # decode: every key visible
]


@needs_fe
@pytest.mark.parametrize("mask,sq,skv,align,left,right", BANDS, ids=[str(i) for i in range(len(BANDS))])
def test_diagonal_band_attributes(mask, sq, skv, align, left, right):
    q, k, v = qkv(Sq=sq, Skv=skv)
    node = json.loads(str(validate_for(ca.AttnProblem.from_tensors(q, k, v, mask=mask), 90)))["nodes"][0]
    assert (node["left_bound"], node["right_bound"]) == (left, right)
    if align is not None:
        assert node["diagonal_alignment"] == align


def _band_cases():
    windows = [(0, 0), (2, 0), (0, 2), (3, 1), (-1, 2), (2, -1), (-1, 0), (-1, -1), (9, 9)]
    for sq, skv in [(7, 7), (5, 9), (9, 5), (1, 6), (6, 1)]:
        for lens in (None, ([sq, max(1, sq - 2)], [skv, max(1, skv - 3)])):
            for causal in (None, "top_left", "bottom_right"):
                for w in windows + [None]:
                    for align in ("top_left", "bottom_right"):
                        if w is None and align == "bottom_right":
                            continue
                        yield sq, skv, lens, causal, None if w is None else (*w, align)


@needs_fe
def test_band_mapping_matches_the_oracle_brute_force():
    accepted = 0
    for sq, skv, lens, causal, window in _band_cases():
        p = Problem(B=2, Hq=1, Sq=sq, Skv=skv, D=8, causal=causal, window=window,
                    seq_lens_q=lens[0] if lens else None, seq_lens_kv=lens[1] if lens else None)
        q, k, v = qkv(B=2, Hq=1, Sq=sq, Skv=skv, D=8)
        spec, reasons = analyze(ca.AttnProblem.from_tensors(q, k, v, mask=p.lib_mask()))
        if reasons:
            assert all(isinstance(r, str) and r for r in reasons)
            continue
        accepted += 1
        band = spec.band  # cuDNN rejects left bounds < 1 and right bounds < 0
        assert band is None or ((band.left is None or band.left >= 1)
                                and (band.right is None or band.right >= 0))
        expected = p.visibility()
        got = cudnn_visibility(spec, 2, *(lens or (None, None)))
        assert torch.equal(got, expected), (sq, skv, lens, causal, window, spec.band)
        if lens:
            empty = padded_rows(spec, *lens)
            assert torch.equal(empty, ~expected.any(-1)), (sq, skv, lens, causal, window)
    assert accepted > 300


@needs_fe
def test_padding_alibi_bias_dbias_dropout_attributes():
    fwd = _json("everything")["nodes"][0]
    assert fwd["padding_mask"] and fwd["alibi_mask"]
    assert fwd["inputs"]["SEQ_LEN_Q"] == UID.SEQ_LEN_Q and fwd["inputs"]["SEQ_LEN_KV"] == UID.SEQ_LEN_KV
    assert fwd["inputs"]["Seed"] == UID.DROPOUT_SEED and fwd["inputs"]["Offset"] == UID.DROPOUT_OFFSET
    import struct

    p32 = struct.unpack("<f", struct.pack("<f", 0.2))[0]
    assert struct.unpack(">f", bytes.fromhex(fwd["dropout_probability"]))[0] == p32
    tensors = _tensors(_json("everything"))
    assert tensors["dropout_seed"]["is_pass_by_value"] and tensors["dropout_seed"]["data_type"] == "INT64"
    bwd = _json("bias-grad", backward=True)
    node, tensors = bwd["nodes"][0], _tensors(bwd)
    assert node["inputs"]["Bias"] == UID.BIAS and node["outputs"]["dBias"] == UID.DBIAS
    assert tensors["dbias"]["dim"] == tensors["bias"]["dim"] == [2, 4, 128, 128]
    bias2d = _tensors(_json("bias-2d"))["bias"]
    assert bias2d["dim"] == [1, 1, 128, 128] and bias2d["stride"][2:] == [128, 1]
    mask_form = _json("dropout-mask", backward=True)["nodes"][0]["inputs"]
    assert (mask_form["Dropout_mask"], mask_form["Dropout_scale"], mask_form["Dropout_scale_inv"]) == (
        UID.DROPOUT_MASK, UID.DROPOUT_SCALE, UID.DROPOUT_SCALE_INV)


@needs_fe
def test_bias_with_ragged_key_tile_gets_a_full_length_padding_mask():
    # S_kv % 128 != 0 with a bias: cuDNN masks the last key tile's padded tail only with a padding
    # mask (cudnn-frontend #160, PyTorch #196678), so the engine adds one with full lengths.
    spec = analyze(_problem("bias-skv100")[0])[0]
    assert spec.padding and spec.synthetic_padding
    assert _json("bias-skv100", backward=True)["nodes"][0]["padding_mask"]
    lens = _runtime.LengthCache(spec).get((96, 96), (100, 100), torch.device("cpu"))
    assert lens[0].flatten().tolist() == [96, 96] and lens[2] is None
    assert not analyze(_problem("bias-1hss")[0])[0].padding  # 128 | S_kv: not needed


@needs_fe
def test_strides_layouts_determinism_ragged_and_pages():
    t = _tensors(_json("dense-bshd-bf16"))
    assert t["q"]["stride"] == [128 * 4 * 128, 128, 4 * 128, 1] and t["q"]["data_type"] == "BFLOAT16"
    assert t["o"]["stride"] == [128 * 4 * 128, 128, 4 * 128, 1]  # out allocated in the call's layout
    assert _tensors(_json("packed-qkv"))["k"]["stride"] == [128 * 3 * 4 * 64, 64, 3 * 4 * 64, 1]
    assert _json("deterministic", backward=True)["nodes"][0]["is_deterministic_algorithm"]
    assert not _json("dense", backward=True)["nodes"][0]["is_deterministic_algorithm"]
    rag = _tensors(_json("ragged", backward=True))
    for name, offsets in (("q", UID.RAGGED_Q), ("k", UID.RAGGED_K), ("v", UID.RAGGED_V),
                          ("o", UID.RAGGED_O), ("do", UID.RAGGED_O), ("dq", UID.RAGGED_Q),
                          ("stats", UID.RAGGED_STATS)):
        assert rag[name]["ragged_offset_uid"] == offsets, name
    assert rag["stats"]["stride"] == [128 * 4, 1, 4, 1]
    assert _json("ragged-causal-max")["nodes"][0]["max_total_seq_len_q"] == 103
    paged = _json("paged")
    node, t = paged["nodes"][0], _tensors(paged)
    assert node["inputs"]["Page_table_K"] == UID.PAGE_TABLE_K and node["max_seq_len_kv"] == 256
    assert t["k"]["dim"] == [16, 2, 64, 64] and t["page_table_v"]["dim"] == [2, 1, 4, 1]


@needs_fe
def test_whitelisted_kwargs_exist_in_the_binding():
    import cudnn

    from cudnn_attn.graphs.sdpa import BACKWARD_KWARGS, FORWARD_KWARGS

    for op, allowed in (("sdpa", FORWARD_KWARGS), ("sdpa_backward", BACKWARD_KWARGS)):
        doc = getattr(cudnn._pybind_module.backend_graph, op).__doc__.split("\n")[0]
        params = set(re.findall(r"(\w+): ", doc)) - {"self"}
        assert allowed <= params, sorted(allowed - params)


# ---------------------------------------------------------------------------------------------
# declines
# ---------------------------------------------------------------------------------------------

REJECTED = [  # (id, tensors, kwargs, options, backward, target_sm, reason fragment)
    ("fp32", qkv(dtype=torch.float32), {}, None, False, None, "float16 or bfloat16"),
    ("fp64", qkv(dtype=torch.float64), {}, None, False, None, "float16 or bfloat16"),
    ("d20", qkv(D=20), {}, None, False, None, "multiples of 8"),
    ("d68-dv100", qkv(D=68, Dv=100), {}, None, False, None, "multiples of 8"),
    ("d264", qkv(D=264), {}, None, False, 90, "up to 256"),
    ("d512", qkv(D=512), {}, None, False, 90, "up to 256"),
    ("last-stride", tuple(torch.empty(2, 4, 128, 128, dtype=F16, device="meta")[..., ::2]
                          for _ in range(3)), {}, None, False, None, "stride 1 along its head dim"),
    # softcap and neighborhoods run as a score_mod, which excludes padding and ALiBi
    ("neighborhood-padding", qkv(Sq=64),
     {"mask": ca.Neighborhood((8, 8), 3) & ca.Padding([64, 30], [64, 30])}, None, False, None,
     "excludes the padding mask"),
    ("softcap-alibi", qkv(), {"softcap": 30.0, "mask": ca.Causal(), "bias": ca.Alibi()}, None,
     False, None, "excludes ALiBi"),
    ("mixed-alignments", qkv(Sq=64, Skv=128),
     {"mask": ca.Causal() & ca.SlidingWindow(8, 0, "bottom_right")}, None, False, None,
     "mix top_left and bottom_right"),
    ("causal-br-sq>skv", qkv(Sq=192, Skv=64), {"mask": ca.Causal("bottom_right")}, None, False,
     None, "S_q <= S_kv without padding"),
    ("window-sq>skv", qkv(Sq=192, Skv=64), {"mask": ca.SlidingWindow(8, 0)}, None, False, None,
     "sliding window needs S_q <= S_kv"),
    # per-batch (padded) bottom-right offsets: without padding the offset is a top-left band's
    ("br-bias", qkv(Sq=64, Skv=128), {"mask": ca.Causal("bottom_right") & ca.Padding(
        [64, 30], [128, 100]), "bias": meta(1, 4, 64, 128)},
     None, False, None, "bottom-right diagonal cannot be combined with a bias"),
    ("br-dropout", qkv(Sq=64, Skv=128), {"mask": ca.Causal("bottom_right") & ca.Padding(
        [64, 30], [128, 100]), "dropout_p": 0.1}, None,
     False, None, "cannot be combined with dropout"),
    ("br-alibi", qkv(Sq=64, Skv=128), {"mask": ca.Causal("bottom_right"), "bias": ca.Alibi()}, None,
     False, None, "cannot be combined with ALiBi"),
    ("alibi-no-causal", qkv(), {"bias": ca.Alibi()}, None, False, None, "ALiBi needs a causal"),
    ("alibi-window-right", qkv(), {"bias": ca.Alibi(), "mask": ca.SlidingWindow(8, 2)}, None, False,
     None, "ALiBi needs a causal"),
    ("alibi-custom-slopes", qkv(), {"bias": ca.Alibi([0.5, 0.25, 0.1, 0.05]), "mask": ca.Causal()},
     None, False, None, "standard slopes only"),
    ("bias-bf16-with-fp16", qkv(), {"bias": meta(1, 4, 128, 128, dtype=BF16)}, None, False, None,
     "as q) or float32"),
    ("bias-fp64", qkv(), {"bias": meta(1, 4, 128, 128, dtype=torch.float64)}, None, False, None,
     "as q) or float32"),
    ("bias-stride", qkv(), {"bias": meta(1, 4, 128, 128).transpose(-1, -2)}, None, False, None,
     "stride 1 along S_kv"),
    ("dbias-broadcast-sq", qkv(), {"bias": meta(2, 4, 1, 128, grad=True)}, None, True, None,
     "spanning S_q and S_kv"),
    ("dbias-expanded", qkv(), {"bias": meta(1, 4, 128, 128, grad=True).expand(2, 4, 128, 128)}, None,
     True, None, "expanded"),
    ("decode-causal-gqa", qkv(Hq=8, Hkv=2, Sq=1, Skv=64), {"mask": ca.Causal()}, None, False, None,
     "decode (S_q = 1)"),
    ("bwd-1x1", qkv(Sq=1, Skv=1), {}, None, True, None, "S_q = S_kv = 1"),
    ("bwd-d256-sm80", qkv(D=256), {}, None, True, 80, "up to 128"),
    ("bwd-d160-sm86", qkv(D=160), {}, None, True, 86, "up to 128"),
    ("sm75", qkv(), {}, None, False, 75, "sm_80 or newer"),
    ("ragged-no-padding", qkv(layout="bshd"), {"layout": "bshd"}, GraphOptions(ragged=True), False,
     None, "need per-sequence lengths"),
    ("ragged-bhsd", qkv(), {"mask": ca.Padding([1, 2])}, GraphOptions(ragged=True), False, None,
     "token-major"),
    ("ragged-bwd-sm80", qkv(layout="bshd"), {"layout": "bshd", "mask": ca.Padding([1, 2])},
     GraphOptions(ragged=True), True, 80, "packed LSE"),
    ("max-total-dense", qkv(), {}, GraphOptions(max_total_seq_len_q=100), False, None,
     "ragged (packed) layouts only"),
    ("paged-bwd", qkv(Skv=256, layout="bshd"), {"layout": "bshd", "mask": ca.Padding([1, 1], [9, 9])},
     GraphOptions(paged=PagedKV(8, 64)), True, None, "no SDPA backward for paged"),
    ("paged-no-padding", qkv(Skv=256, layout="bshd"), {"layout": "bshd"},
     GraphOptions(paged=PagedKV(8, 64)), False, None, "need per-sequence lengths"),
    ("paged-page-size", qkv(Skv=240, layout="bshd"), {"layout": "bshd", "mask": ca.Padding([1, 1])},
     GraphOptions(paged=PagedKV(8, 48)), False, None, "power of two"),
    ("dropout-both-forms", qkv(), {"dropout_p": 0.1}, GraphOptions(dropout_mask=True), False, None,
     "not both"),
    ("deterministic-dropout-sm100", qkv(), {"dropout_p": 0.1}, GraphOptions(deterministic=True), True,
     100, "deterministic backward on sm_100 excludes dropout"),
]


@needs_fe
@pytest.mark.parametrize("case", REJECTED, ids=[c[0] for c in REJECTED])
def test_rejected_combinations_are_declined_with_a_reason(case):
    _, (q, k, v), kwargs, options, backward, sm, fragment = case
    problem = ca.AttnProblem.from_tensors(q, k, v, **kwargs)
    reasons = ca.graphs.cudnn_reasons(problem, sm, options=options, backward=backward)
    assert any(fragment in r for r in reasons), reasons
    with pytest.raises(ca.NotSupportedError) as err:
        describe(q, k, v, backward=backward, target_sm=sm, options=options, **kwargs)
    assert any(fragment in r for r in err.value.reasons["cudnn"])


def _raw_spec(name, **changes):
    import dataclasses

    spec = analyze(_problem(name)[0])[0]
    return dataclasses.replace(spec, **changes)


@needs_fe
@pytest.mark.parametrize("changes,backward,sm", [
    (dict(band=ca.graphs._spec.Band("bottom_right", None, 0), bias_dim=(1, 4, 64, 128),
          bias_stride=(32768, 8192, 128, 1), bias_dtype="float16", seq_q=64), False, 90),
    (dict(alibi=True), False, 90),
    (dict(band=ca.graphs._spec.Band("top_left", 9, 0), seq_q=192, seq_kv=64), False, 90),
    (dict(band=ca.graphs._spec.Band("bottom_right", None, 0), seq_q=192, seq_kv=64), True, 90),
    (dict(band=ca.graphs._spec.Band("bottom_right", None, 0), dropout_p=0.1, seq_q=64), False, 90),
    (dict(dim_qk=20, dim_v=20, q_stride=(2560, 20, 20, 1), k_stride=(2560, 20, 20, 1),
          v_stride=(2560, 20, 20, 1), seq_q=32, seq_kv=32), False, 90),
    (dict(seq_q=1, seq_kv=1), True, 90),
    (dict(dim_qk=256, dim_v=256, q_stride=(131072, 32768, 256, 1), k_stride=(131072, 32768, 256, 1),
          v_stride=(131072, 32768, 256, 1)), True, 80),
], ids=["br+bias", "alibi-no-band", "swa-sq>skv", "br-sq>skv", "br+dropout", "d20", "bwd-1x1",
        "bwd-d256-sm80"])
def test_the_frontend_rejects_what_the_rules_decline(changes, backward, sm):
    import cudnn

    from cudnn_attn.graphs import sdpa

    spec = _raw_spec("dense", **changes)
    spec = spec.backward_variant() if backward else spec.forward_variant(True)
    g = sdpa._new_graph(spec, sm=sm, cpp=True)
    sdpa.emit(g, spec, backward)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError):
        g.validate()


# ---------------------------------------------------------------------------------------------
# the plan's host logic, against a stand-in for cuDNN's execute
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def fake_cudnn(monkeypatch):
    """``backend="cudnn"`` runs on this CPU through ``FakeGraph`` and a private graph cache."""
    yield cudnn_fake.install(monkeypatch)
    clear_caches()


PLAN_CASES = [
    Problem(id="padding-causal-br-gqa-bshd", B=3, Hq=4, Hkv=2, Sq=12, Skv=10, D=16, layout="bshd",
            causal="bottom_right", seq_lens_q=(12, 9, 2), seq_lens_kv=(10, 4, 0)),
    Problem(id="bias-grad-skv20", B=2, Hq=2, Sq=9, Skv=20, D=8, bias_shape=(1, 2, 9, 20)),
    Problem(id="alibi-h3-causal-padding", B=2, Hq=3, Sq=11, D=8, causal="top_left", alibi="default",
            seq_lens_q=(11, 6), seq_lens_kv=(11, 8)),
    Problem(id="window-dv8", B=1, Hq=2, Sq=14, Skv=16, D=16, Dv=8, window=(2, 1)),
    # Any sign of the scale: cuDNN hides pairs before it scales (the stand-in does too), so
    # the plan binds a positive scale and carries the sign on q (issue 36).
    Problem(id="causal-negative-scale", B=1, Hq=2, Sq=10, D=16, causal="top_left", scale=-0.7),
    Problem(id="causal-zero-scale", B=1, Hq=2, Sq=10, D=16, causal="top_left", scale=0.0),
    Problem(id="window-zero-scale", B=1, Hq=2, Sq=10, D=16, window=(2, 1), scale=0.0),
    Problem(id="padding-br-gqa-bshd-negative-scale", B=2, Hq=4, Hkv=2, Sq=9, Skv=12, D=16,
            layout="bshd", causal="bottom_right", seq_lens_q=(9, 3), seq_lens_kv=(12, 5),
            scale=-0.01),
]


@needs_fe
@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in PLAN_CASES])
def test_plan_forward_backward_match_the_oracle(problem, fake_cudnn):
    inp = problem.make_inputs(torch.float16, seed=5, requires_grad=True)
    names = [n for n in ("q", "k", "v", "bias") if inp[n] is not None]
    ref_inp = {n: inp[n].detach().double().requires_grad_(True) for n in names}
    ref, ref_lse = problem.run_oracle({**inp, **ref_inp})  # fp64 from the same fp16 values
    out, lse = problem.run_lib(inp, backend="cudnn")
    assert fake_cudnn[1], "the cudnn plan did not run"
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)  # -inf rows included
    gen = torch.Generator().manual_seed(9)
    g_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64)

    def loss(o, lse_):  # uses the LSE too: its gradient must reach q and k
        return (o.double() * g_out).sum() + (lse_.double().masked_fill(lse_.isinf(), 0) * g_lse).sum()

    got = torch.autograd.grad(loss(out, lse), [inp[n] for n in names])
    expected = torch.autograd.grad(loss(ref, ref_lse), [ref_inp[n] for n in names])
    for n, a, e in zip(names, got, expected):
        assert not a.isnan().any(), f"NaN in d{n}"
        torch.testing.assert_close(a.double(), e, atol=2e-2, rtol=2e-2, msg=lambda m, n=n: f"d{n}: {m}")


@pytest.mark.parametrize("scale, factor, graph_scale", [(0.3, 1.0, 0.3), (-0.3, -1.0, 0.3),
                                                        (0.0, 0.0, 1.0), (-0.0, 0.0, 1.0)])
def test_the_graph_always_gets_a_positive_scale(scale, factor, graph_scale):
    """cuDNN hides pairs before it scales (issue 36): the sign goes onto q, exactly."""
    assert _runtime.positive_scale(scale) == (factor, graph_scale)


@pytest.mark.parametrize("view", ["qkv-packed", "broadcast", "offset"])
def test_q_times_its_factor_keeps_the_strides_the_graph_was_built_for(view):
    g = torch.Generator().manual_seed(0)
    if view == "qkv-packed":  # [B, S, 3, H, D] -> q: gapped strides
        t = torch.randn(2, 5, 3, 4, 8, generator=g).to(torch.float16)[:, :, 0]
    elif view == "broadcast":  # stride 0 along H
        t = torch.randn(2, 1, 5, 8, generator=g).to(torch.float16).expand(2, 4, 5, 8)
    else:
        t = torch.randn(100, generator=g).to(torch.float16)[3:83].view(2, 5, 8)
    for factor in (-1.0, 0.0):
        got = _runtime.scaled_same_strides(t, factor)
        assert got.stride() == t.stride() and got.shape == t.shape
        assert got.data_ptr() != t.data_ptr() and got.data_ptr() % 16 == 0
        assert torch.equal(got, t * factor)


@needs_fe
@pytest.mark.parametrize("bias_shape", [(2, 1, 1, 16), (1, 1, 12, 1), "expanded"])
def test_backward_binds_a_bias_broadcast_along_s_as_full_rows(bias_shape, fake_cudnn):
    """cuDNN's backward reads (1|B, 1|H_q, S_q, S_kv) biases only (issue 23: dQ off by ~1.4 on
    an H200 for a (B, 1, 1, S_kv) bias): the backward graph declares the full rows and the plan
    binds a materialised copy; the gradients still match the float64 oracle."""
    p = Problem(B=2, Hq=2, Sq=12, Skv=16, D=8)
    inp = p.make_inputs(torch.float16, seed=4, requires_grad=True)
    gen = torch.Generator().manual_seed(6)
    if bias_shape == "expanded":  # stride 0 along H and S_q
        bias = torch.randn(2, 1, 1, 16, generator=gen).to(torch.float16).expand(2, 2, 12, 16)
    else:
        bias = torch.randn(bias_shape, generator=gen).to(torch.float16)
    leaves = [inp[n] for n in ("q", "k", "v")]
    out = ca.attention(*leaves, bias=bias, backend="cudnn")
    (spec, backward), = [b for b in fake_cudnn[1] if b[1]] or [(None, None)]
    assert spec is not None and tuple(spec.bias_dim[2:]) == (12, 16)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    q, k, v = ref_leaves
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + bias.double(), -1) @ v
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * g).sum(), leaves)
    want = torch.autograd.grad((ref * g).sum(), ref_leaves)
    for name, a, e in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), e, atol=2e-2, rtol=2e-2,
                                   msg=lambda m, n=name: f"d{n}: {m}")


@needs_fe
def test_plan_dropout_seed_reaches_the_backward(fake_cudnn):
    p = Problem(B=1, Hq=2, Sq=8, D=8, causal="top_left")
    inp = p.make_inputs(torch.float16, seed=2, requires_grad=True)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        out = ca.attention(inp["q"], inp["k"], inp["v"], mask=p.lib_mask(), dropout_p=0.3,
                           generator=gen, backend="cudnn")
        out.sum().backward()
        return out.detach()

    a, b, c = run(1), run(1), run(2)
    fwd, bwd = (g for g in _graphs(fake_cudnn))
    assert fwd.seeds[0] == fwd.seeds[1] != fwd.seeds[2]
    assert bwd.seeds == fwd.seeds  # each backward replays its forward's Philox state
    assert torch.equal(a, b) and not torch.equal(a, c)


def _graphs(fake):
    cache, _ = fake
    return [cache.get_or_build(key, None) for key in cache.keys()]


@needs_fe
def test_plan_reuses_cached_graphs(fake_cudnn):
    cache, built = fake_cudnn
    q, k, v = qkv(device="cpu", Sq=16, D=8)
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.3, backend="cudnn")
    assert len(built) == 1 and cache.info()["misses"] == 1
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.9, backend="cudnn")  # new scale: same graph
    dispatch.get_backend("cudnn").clear()  # forget plans: graphs come from the cache
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.5, backend="cudnn")
    assert len(built) == 1 and cache.info()["hits"] >= 1
    ca.attention(q, k, v, mask=ca.Causal(), return_lse=True, backend="cudnn")
    assert len(built) == 2 and built[1][0].stats  # the variant with stats is another graph


@needs_fe
def test_forgotten_calls_and_plans_rebuild_no_graph(fake_cudnn):
    """What tests/engines/test_cudnn_gpu.py::test_cache_hits_cause_no_rebuild checks on the GPU, on the
    caches API (issue 23: it used a removed ``api._CALL_CACHE``)."""
    cache, built = fake_cudnn
    q, k, v = qkv(device="cpu", Sq=16, D=8)
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.3, backend="cudnn")
    assert cache_sizes()["api.calls"] >= 1
    hits = cache.info()["hits"]
    clear_caches("api.calls")
    assert cache_sizes()["api.calls"] == 0 and len(cache.keys()) == 1
    dispatch.get_backend("cudnn").clear()
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.4, backend="cudnn")
    assert len(built) == 1 and cache.info()["hits"] > hits


# ---------------------------------------------------------------------------------------------
# this CPU machine
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_supports_says_no_cuda_device_and_torch_is_selected():
    q, k, v = qkv(device="cpu", Sq=16, D=8)
    problem = ca.AttnProblem.from_tensors(q, k, v, mask=ca.Causal())
    reasons = dispatch.get_backend("cudnn").supports(problem)
    assert any("no CUDA device" in r for r in reasons), reasons
    assert not any("not built yet" in r for r in reasons)
    verdicts = ca.explain(q, k, v, mask=ca.Causal())
    assert verdicts["torch"] == "selected" and verdicts.selected == "torch"
    assert any("no CUDA device" in r for r in verdicts["cudnn"])
    out = ca.attention(q, k, v, mask=ca.Causal())
    assert out.shape == q.shape and not out.isnan().any()
    with pytest.raises(ca.NotSupportedError, match="no CUDA device"):
        ca.attention(q, k, v, backend="cudnn")


def test_importing_the_package_does_not_import_cudnn():
    import subprocess
    import sys

    code = ("import sys, torch, cudnn_attn; from cudnn_attn import graphs; from cudnn_attn.graphs "
            "import describe, backend, sdpa; assert 'cudnn' not in sys.modules, 'cudnn imported'\n"
            "if not torch.cuda.is_available():\n"
            "    q = torch.randn(1, 2, 8, 8); cudnn_attn.attention(q, q, q); cudnn_attn.explain(q, q, q)\n"
            "    assert 'cudnn' not in sys.modules, 'a CPU call imported cudnn'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(
        __file__).resolve().parents[2]))


def test_problem_dropout_mask_selects_the_mask_dropout_graph():
    # A problem carrying an explicit dropout mask (AttnProblem.dropout_mask, the attribute
    # builder's set_dropout(mask, scale)) maps onto the mask-dropout graph, as the option does.
    q, k, v = qkv()
    keep = torch.ones(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=torch.bool,
                      device=q.device)
    problem = ca.AttnProblem.from_tensors(q, k, v, dropout_mask=keep, dropout_scale=2.0)
    spec, reasons = analyze(problem, target_sm=90, backward=True)
    assert reasons == [] and spec.dropout_mask
    assert spec == analyze(ca.AttnProblem.from_tensors(q, k, v), target_sm=90, backward=True,
                           options=GraphOptions(dropout_mask=True))[0]
    both = ca.AttnProblem.from_tensors(q, k, v, dropout_p=0.1)  # the model refuses both itself
    object.__setattr__(both, "dropout_mask", problem.dropout_mask)
    assert any("not both" in r for r in analyze(both, target_sm=90)[1])


@needs_fe
def test_unpadded_backward_launches_no_lse_fixup(fake_cudnn):
    """Per-call work of the cuDNN backward: without padding no row lacks a key, so the LSE is
    bound as is (issue 23's profile: backward at S=1024 ran at 0.66x the bare execute); the
    ``-inf -> +inf`` fix-up (``eq`` + ``masked_fill``) runs only for padded graphs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = (t.requires_grad_(True) for t in qkv(device="cpu", Sq=16, D=8))
    # With the lse the call takes the plan's own forward and backward (without it, the direct
    # runner: test_cudnn_direct_call.py).
    out, _ = ca.attention(q, k, v, backend="cudnn", return_lse=True)
    plan_backward = dispatch.get_backend("cudnn").plan(
        ca.AttnProblem.from_tensors(q, k, v, return_lse=True)).backward
    calls = []

    def spy(*args, **kwargs):
        with Ops() as ops:  # the host's ops around cuDNN's execute (a no-op here)
            result = plan_backward(*args, **kwargs)
        calls.append(ops.names)
        return result
    import cudnn_attn.graphs.backend as gb
    monkey = pytest.MonkeyPatch()
    try:
        monkey.setattr(gb.CudnnPlan, "backward", lambda self, *a, **kw: spy(*a, **kw))
        monkey.setattr(cudnn_fake.FakeGraph, "execute", lambda self, *a: None)
        torch.autograd.grad(out.float().sum(), [q, k, v])
    finally:
        monkey.undo()
    assert calls, "the cuDNN backward did not run"
    assert not any(n.startswith(("eq", "masked_fill")) for n in calls[0]), calls[0]
