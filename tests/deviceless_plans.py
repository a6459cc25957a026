"""Deviceless cuDNN plans for the tests: the driver stand-in fixture and every graph family the
cuDNN engine emits.

* ``deviceless`` (fixture): ``cudnn_attn.graphs.deviceless`` with the libcuda stand-in compiled
  (by the C compiler, as ``host_cuda`` builds its code) and loaded; the test fails, naming the
  problem, when it cannot be (never a skip). ``conftest.py`` loads it before any test runs,
  because cuDNN remembers a failed load of its runtime-compiled engines for the whole process.
* ``FAMILIES``: name -> ``Family`` (the problem as the engine receives it, builder options,
  directions). Sinks and ``H_k != H_v`` are listed through the rewrites every engine applies
  (``return_lse`` for the sink merge, repeated heads): the graph cuDNN gets is that one.
* ``assert_plans(problem, target, backward=..., options=...)``: for new graph kinds (other
  modules' tests): the engine's verdict for ``target`` and cuDNN's must agree; returns the
  ``PlanResult``.

``TARGETS`` are the architectures the CPU suite plans for (A100 sm_80, H100 sm_90, B200 sm_100;
H200 is an sm_90 part with another memory system and plans as H100 does).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.graphs._spec import GraphOptions, PagedKV, analyze
from cudnn_attn.graphs.buckets import BucketPolicy
from cudnn_attn.rewrites.kv_heads import repeat_to_common_heads
from full_sweep import FULL  # noqa: F401  (re-exported: the plan tests import it from here)

TARGETS = ("a100", "h100", "b200")
F16, BF16 = torch.float16, torch.bfloat16
needs_fe = pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                              reason="nvidia-cudnn-frontend is not installed")


def load_driver() -> Optional[str]:
    """Compile and load the stand-in now; the error text when it cannot be (else ``None``)."""
    if importlib.util.find_spec("cudnn") is None:
        return None
    from cudnn_attn.graphs import driver_standin

    try:
        driver_standin.ensure_driver()
    except driver_standin.DriverUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def deviceless():
    error = load_driver()
    if error:
        pytest.fail(error, pytrace=False)
    from cudnn_attn.graphs import deviceless as module

    return module


@dataclass(frozen=True)
class Family:
    """One graph family: ``problem`` (as the engine analyzes it), ``options`` (storage the
    problem's tensors do not carry: ragged offsets, page tables, the mask form of dropout,
    determinism), and whether it has a backward graph."""

    problem: ca.AttnProblem
    options: Optional[GraphOptions] = None
    backward: bool = True
    note: str = field(default="", compare=False)


def meta(*shape, dtype=F16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def qkv(B=2, Hq=4, Hkv=None, Sq=256, Skv=None, D=64, Dv=None, dtype=F16, layout="bhsd"):
    Hkv, Skv, Dv = Hkv or Hq, Skv or Sq, Dv or D

    def t(H, S, d):
        return meta(*((B, H, S, d) if layout == "bhsd" else (B, S, H, d)), dtype=dtype)

    return t(Hq, Sq, D), t(Hkv, Skv, D), t(Hkv, Skv, Dv)


def family(tensors, options=None, backward=True, note="", **kwargs) -> Family:
    return Family(ca.AttnProblem.from_tensors(*tensors, **kwargs), options, backward, note)


def _h_k_not_h_v() -> Family:
    q, k, v = meta(2, 8, 256, 64), meta(2, 2, 256, 64), meta(2, 4, 256, 64)
    k, v = repeat_to_common_heads(q, k, v, "bhsd")  # what every engine receives (kv_heads)
    return family((q, k, v), mask=ca.Causal(), note="H_q=8, H_k=2, H_v=4 as GQA over lcm heads")


def _bucket() -> Family:
    # a serving bucket: lengths padded to BucketPolicy's shape, real lengths as runtime Padding
    shape = BucketPolicy(min_seq=128, max_seq=1024, max_batch=8).bucket(3, 300, 300)
    lens = torch.empty(shape.batch, dtype=torch.int32, device="meta")  # runtime lengths
    return family(qkv(B=shape.batch, Hq=8, Hkv=2, Sq=shape.seq_q, Skv=shape.seq_kv, D=128,
                      dtype=BF16), mask=ca.Padding(lens, lens) & ca.Causal("bottom_right"),
                  note=f"bucket {tuple(shape)}")


def _families() -> dict:
    runtime = torch.empty(2, dtype=torch.int32, device="meta")
    out = {
        "dense": family(qkv()),
        "dense-bshd-bf16-d128": family(qkv(D=128, dtype=BF16, layout="bshd"), layout="bshd"),
        "gqa-causal": family(qkv(Hq=8, Hkv=2), mask=ca.Causal()),
        "mqa": family(qkv(Hq=8, Hkv=1)),
        "d192-dv128-causal": family(qkv(D=192, Dv=128, dtype=BF16), mask=ca.Causal()),
        "d256": family(qkv(D=256, dtype=BF16)),
        "causal-top-left": family(qkv(Sq=128, Skv=384), mask=ca.Causal()),
        "causal-bottom-right": family(qkv(Sq=128, Skv=384), mask=ca.Causal("bottom_right")),
        "window": family(qkv(), mask=ca.SlidingWindow(64, 0)),
        "window-two-sided": family(qkv(Sq=200, Skv=320), mask=ca.SlidingWindow(32, 16)),
        "window-bottom-right": family(qkv(Sq=128, Skv=384),
                                      mask=ca.SlidingWindow(64, 0, "bottom_right")),
        "padding": family(qkv(B=3), mask=ca.Padding([256, 5, 1], [200, 256, 7])),
        "padding-causal-bottom-right": family(qkv(Sq=384, Skv=128), mask=ca.Padding(
            [384, 30], [128, 50]) & ca.Causal("bottom_right")),
        "runtime-lengths": family(qkv(), mask=ca.Padding(runtime, runtime) & ca.Causal()),
        "serving-bucket": _bucket(),
        "alibi-causal": family(qkv(), mask=ca.Causal(), bias=ca.Alibi()),
        "bias-1hss": family(qkv(), bias=meta(1, 4, 256, 256)),
        "bias-b11s": family(qkv(), bias=meta(2, 1, 1, 256)),
        "bias-fp32": family(qkv(), bias=meta(1, 4, 256, 256, dtype=torch.float32)),
        "bias-dbias-causal": family(qkv(), bias=meta(2, 4, 256, 256, grad=True),
                                    mask=ca.Causal()),
        "bias-skv-not-tiled": family(qkv(Sq=192, Skv=200), bias=meta(1, 4, 192, 200, grad=True)),
        # backward graphs with S % 128 != 0 carry a full-length padding mask (_spec._open_tiles)
        "open-tails": family(qkv(Sq=192, Skv=192), note="S % 128 == 64, no mask"),
        "open-tails-one-query": family(qkv(Sq=1, Skv=128), note="the query tail (#1072)"),
        "dropout-causal": family(qkv(), dropout_p=0.1, mask=ca.Causal()),
        "dropout-mask": family(qkv(), GraphOptions(dropout_mask=True)),
        "everything": family(qkv(), mask=ca.Causal() & ca.Padding([256, 77]), bias=ca.Alibi(),
                             dropout_p=0.2),
        "deterministic": family(qkv(), GraphOptions(deterministic=True), mask=ca.Causal()),
        "deterministic-dropout": family(qkv(), GraphOptions(deterministic=True), dropout_p=0.1),
        "deterministic-alibi": family(qkv(), GraphOptions(deterministic=True), mask=ca.Causal(),
                                      bias=ca.Alibi()),
        "deterministic-dbias": family(qkv(), GraphOptions(deterministic=True),
                                      bias=meta(1, 4, 256, 256, grad=True)),
        "d160-dv160": family(qkv(D=160, dtype=BF16)),
        "sinks": family(qkv(), return_lse=True, note="sinks merge through the LSE"),
        "h_k!=h_v": _h_k_not_h_v(),
        "decode-bottom-right": family(qkv(Sq=1, Skv=512), mask=ca.Causal("bottom_right")),
        "ragged": family(qkv(layout="bshd"), GraphOptions(ragged=True), layout="bshd",
                         mask=ca.Padding([200, 3], [256, 60])),
        "ragged-causal-max-total": family(
            qkv(layout="bshd"), GraphOptions(ragged=True, max_total_seq_len_q=203,
                                             max_total_seq_len_kv=316),
            layout="bshd", mask=ca.Padding([200, 3], [256, 60]) & ca.Causal("bottom_right")),
        "ragged-dbias": family(qkv(layout="bshd"), GraphOptions(ragged=True), layout="bshd",
                               mask=ca.Padding([200, 3], [256, 60]),
                               bias=meta(2, 4, 256, 256, grad=True)),
        "paged-decode": family(qkv(Sq=1, Skv=512, Hkv=2, Hq=8, layout="bshd"),
                               GraphOptions(paged=PagedKV(num_blocks=16, page_size=64)),
                               backward=False, layout="bshd",
                               mask=ca.Padding([1, 1], [100, 512])),
    }
    return out


FAMILIES = _families()


# "fwd": the inference forward (no stats); "fwd-stats": the training forward (with the LSE the
# backward reads, or a returned LSE); "bwd": the backward.
DIRECTIONS = ("fwd", "fwd-stats", "bwd")


def directions(fam: Family) -> tuple:
    return DIRECTIONS if fam.backward else DIRECTIONS[:2]


def cases(sample: bool = False):
    """``(family, direction, target)`` triples: all of them, or with ``sample`` a deterministic
    subset (every fourth family; directions and targets rotating) that keeps the CPU suite
    short: a plan build costs 0.3-1.5 s of CPU, the check that stops at ``check_support``
    about 10 ms."""
    out = []
    for i, (name, fam) in enumerate(FAMILIES.items()):
        if not sample:
            out += [(name, d, t) for d in directions(fam) for t in TARGETS]
        elif i % 4 == 0:
            ds = directions(fam)
            out.append((name, ds[(i // 4) % len(ds)], TARGETS[(i // 4) % len(TARGETS)]))
    return out


def problem_for(name: str, direction: str) -> ca.AttnProblem:
    """The family's problem as the engine sees it for ``direction``."""
    import dataclasses

    problem = FAMILIES[name].problem
    if direction == "fwd":
        return dataclasses.replace(problem, return_lse=False, requires_grad=False)
    if direction == "fwd-stats" and not problem.return_lse:
        return dataclasses.replace(problem, return_lse=True)
    return problem


def assert_plans(deviceless_module, problem, target, *, backward=False, options=None,
                 build=True):
    """The engine claims ``problem`` on ``target`` exactly when cuDNN plans its graph (the
    forward with stats when the problem needs a backward or its LSE); returns cuDNN's
    ``PlanResult``: of the claimed graph, or of the raw graph the engine declined."""
    from cudnn_attn.graphs.targets import target as as_target

    device = as_target(target)
    declared = analyze(problem, target_sm=device.sm, options=options, backward=backward)[1]
    spec, general = analyze(problem, options=options, backward=backward)
    assert not general, f"not a cuDNN problem on any architecture: {general}"
    spec = spec.backward_variant() if backward else spec.forward_variant(
        problem.requires_grad or problem.return_lse)
    result = deviceless_module.plan_spec(spec, backward, device, build=build)
    if declared:
        assert not result.ok, (f"the engine declines on {device.name} ({declared}) but cuDNN "
                               f"plans it: {result.engine}")
    else:
        assert result.ok, f"the engine claims it on {device.name}, cuDNN refused: {result.refusal}"
    return result
