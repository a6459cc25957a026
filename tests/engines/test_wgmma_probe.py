"""The wgmma layout probe (``fallback_kernels/wgmma_probe.py``) under the host emulation.

The probe is the GPU's check of the operand layouts the wgmma kernels read through descriptors;
here it runs on the CPU as the emulation reads the PTX ISA, against float64 matmuls: exact, on
every shape the kernels use. A wrong descriptor in the probe's path (the stride between V's
64-column blocks) must show, so that the probe can tell a layout from its neighbours.
"""

from __future__ import annotations

import pytest
import torch
from host_cuda import build

from cudnn_attn.fallback_kernels import _loader, fused_build, wgmma_probe

DTYPES = (torch.float16, torch.bfloat16)
HOPPER_TEXT = _loader.source_text(fused_build.SOURCE, fused_build.HOPPER_DEFINES)
# na_pv_wgmma's descriptor of V: the leading byte offset is the stride between its 64-column
# blocks (KEYS rows of 128 bytes each); half of it reads the first block's second half.
WRONG_BLOCK_STRIDE = ("na_wg_desc(V, KEYS * 128, 1024)", "na_wg_desc(V, KEYS * 64, 1024)")


def _expressions():
    return [wgmma_probe.expression(dt, hd, keys) for dt in DTYPES
            for hd, keys in wgmma_probe.SHAPES]


def run_on_host(lib, given):
    """``wgmma_probe.run`` on the host emulation (``lib`` holds the probe's instances)."""
    (keys, head_dim), dtype = given["k"].shape, given["q"].dtype
    out = wgmma_probe.outputs_like(given)
    kernel = lib[build.export_name(wgmma_probe.expression(dtype, head_dim, keys))]
    kernel((1, 1, 1), (fused_build.THREADS, 1, 1),
           [given["q"], given["k"], given["v"], given["p"], out["s_ss"], out["s_rs"],
            out["o_pv"]], shared_mem=wgmma_probe.smem_bytes(dtype, head_dim, keys))
    if keys != 64:
        del out["s_rs"]
    return out


def _probe(lib, dtype, head_dim, keys, seed=0):
    given = wgmma_probe.inputs(dtype, head_dim, keys, seed)
    return wgmma_probe.mismatches(run_on_host(lib, given), wgmma_probe.expected(given))


@pytest.fixture(scope="module")
def probe_lib(request, tmp_path_factory):
    return build.host_library(request, tmp_path_factory, fused_build, _expressions(),
                              source=HOPPER_TEXT)


@pytest.mark.parametrize("shape", wgmma_probe.SHAPES, ids=lambda s: f"hd{s[0]}-keys{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_probe_is_exact_under_emulation(probe_lib, dtype, shape):
    assert _probe(probe_lib, dtype, *shape) == {}
    assert _probe(probe_lib, dtype, *shape, seed=1) == {}


def test_the_probe_sees_a_wrong_block_stride(request, tmp_path_factory):
    old, new = WRONG_BLOCK_STRIDE
    assert HOPPER_TEXT.count(old) == 1, "the kernel text changed"
    lib = build.host_library(request, tmp_path_factory, fused_build,
                             [wgmma_probe.expression(torch.bfloat16, hd, keys)
                              for hd, keys in wgmma_probe.SHAPES],
                             source=HOPPER_TEXT.replace(old, new))
    found = {shape: _probe(lib, torch.bfloat16, *shape) for shape in wgmma_probe.SHAPES}
    assert found[(64, 64)] == {}  # one 64-column block: the stride is never used
    for shape in ((128, 64), (128, 32), (128, 16)):
        assert list(found[shape]) == ["o_pv"], found[shape]
        # the second 64-column block, wrong nearly everywhere (a few sums agree by chance)
        assert found[shape]["o_pv"]["count"] > 0.9 * 128 * 64
        assert all(col >= 64 for _, col, _, _ in found[shape]["o_pv"]["first"])


def test_expected_and_mismatches():
    given = wgmma_probe.inputs(torch.bfloat16, 64, 32)
    want = wgmma_probe.expected(given)
    assert set(want) == {"s_ss", "o_pv"} and want["o_pv"].shape == (128, 64)
    got = {name: t.clone() for name, t in want.items()}
    assert wgmma_probe.mismatches(got, want) == {}
    got["o_pv"][3, 5] += 1
    found = wgmma_probe.mismatches(got, want)
    assert found["o_pv"]["count"] == 1 and found["o_pv"]["first"][0][:2] == (3, 5)


# --- the gate: fused launches a wgmma kernel only where the probe is exact on the device ---------

class _Stream:
    index = 0


@pytest.fixture
def gate(monkeypatch):
    """fused's wgmma gate on an sm_90 device that runs the probe through ``gate.lib``; returns
    a namespace with ``probes`` (device indices probed)."""
    from types import SimpleNamespace

    from cudnn_attn.fallback_kernels import fused

    state = SimpleNamespace(lib=None, probes=[])

    def run(given, device=None):
        state.probes.append(device)
        return run_on_host(state.lib, given)

    fused._wgmma_layouts_read_right.cache_clear()
    monkeypatch.setattr(wgmma_probe, "run", run)
    monkeypatch.setattr(fused, "_capability", lambda index: (9, 0))
    monkeypatch.setenv(fused_build.HOPPER_ENV, "1")
    yield state
    fused._wgmma_layouts_read_right.cache_clear()


def test_the_gate_launches_wgmma_once_the_probe_is_exact(gate, probe_lib):
    from cudnn_attn.fallback_kernels import fused

    gate.lib = probe_lib
    for _ in range(2):
        assert fused._on_wgmma("na_fused_forward", torch.bfloat16, 128, _Stream()) == \
            "na_fused_forward_wgmma"
    assert len(gate.probes) == 2 * len(wgmma_probe.SHAPES)  # both types, once per device
    assert fused._on_wgmma("na_fused_forward", torch.bfloat16, 32, _Stream()) == \
        "na_fused_forward"  # no wgmma at head dim 32: nothing asked


def test_a_wrong_layout_keeps_the_mma_sync_kernels(gate, request, tmp_path_factory):
    from cudnn_attn.fallback_kernels import fused

    old, new = WRONG_BLOCK_STRIDE
    gate.lib = build.host_library(request, tmp_path_factory, fused_build, _expressions(),
                                  source=HOPPER_TEXT.replace(old, new))
    with pytest.warns(RuntimeWarning, match=r"ignored on cuda:0.*bfloat16 hd128 keys64"):
        kernel = fused._on_wgmma("na_fused_backward_dq", torch.float16, 128, _Stream())
    assert kernel == "na_fused_backward_dq"
    fused._on_wgmma("na_fused_backward_dq", torch.float16, 128, _Stream())  # no second warning
    assert len(gate.probes) == 2 * len(wgmma_probe.SHAPES)


def test_a_capture_keeps_the_mma_sync_kernels_without_probing(gate, probe_lib, monkeypatch):
    from cudnn_attn.fallback_kernels import fused
    from cudnn_attn.graphs import _runtime

    gate.lib = probe_lib
    monkeypatch.setattr(_runtime, "capturing", lambda: True)
    assert fused._on_wgmma("na_fused_forward", torch.bfloat16, 64, _Stream()) == "na_fused_forward"
    assert gate.probes == []  # the probe syncs: never under capture
    monkeypatch.setattr(_runtime, "capturing", lambda: False)
    assert fused._on_wgmma("na_fused_forward", torch.bfloat16, 64, _Stream()) == \
        "na_fused_forward_wgmma"
