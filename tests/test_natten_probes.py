"""NATTEN 0.21.7's probe names in ``cudnn_attn.natten``: the same names and signatures as the
installed NATTEN 0.21.7, the same values on this CPU, NATTEN's default tiles on the GPU families
(device capability faked), and every listed tile accepted by ``na*d`` as a hint."""

from __future__ import annotations

import inspect

import pytest
import torch

import cudnn_attn.natten as ours
from cudnn_attn.compat.natten import probes

natten = pytest.importorskip("natten")

PROBES = sorted(n for n in dir(natten) if n.startswith(("get_configs_for_", "get_bwd_configs_for_")))


def test_version_and_libnatten_flag():
    assert ours.__version__ == natten.__version__ == "0.21.7"
    assert ours.HAS_LIBNATTEN is True and "HAS_LIBNATTEN" in ours.__all__


@pytest.mark.parametrize("name", PROBES)
def test_probe_signature_is_natten_s(name):
    assert name in ours.__all__
    theirs, mine = inspect.signature(getattr(natten, name)), inspect.signature(getattr(ours, name))
    assert [(p.name, p.default) for p in theirs.parameters.values()] == \
        [(p.name, p.default) for p in mine.parameters.values()]


@pytest.mark.parametrize("name", PROBES)
@pytest.mark.parametrize("shape", [(1, 16, 2, 32), (1, 8, 8, 2, 64), (1, 4, 4, 4, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_probe_values_equal_natten_s_on_this_device(name, shape, dtype):
    q = torch.randn(shape).to(dtype)
    if "fmha" in name and q.dim() != 4:
        with pytest.raises(ValueError, match="Only 4-D tensors"):
            getattr(ours, name)(q, q, q)
        return
    assert getattr(ours, name)(q, q, q) == getattr(natten, name)(q, q, q)


def test_gpu_families_list_natten_s_default_tiles(monkeypatch):
    from natten.backends.configs import cutlass_blackwell, cutlass_hopper

    q2 = torch.randn(1, 8, 8, 2, 64, dtype=torch.float16)
    monkeypatch.setattr(probes, "_capability", lambda q: 90)
    (tiles, schedule), = ours.get_configs_for_cutlass_hopper_fna(q2, q2, q2)
    theirs = cutlass_hopper.HOPPER_FORWARD_CONFIGS[2][16][64][0]
    assert (tiles, schedule.name) == (theirs[0], theirs[1].name)
    assert ours.get_bwd_configs_for_cutlass_hopper_fna(q2, q2, q2) == \
        [cutlass_hopper.HOPPER_BACKWARD_CONFIGS[2][16][64][0]]
    assert ours.get_configs_for_cutlass_hopper_fna(q2.float(), q2, q2) == []  # 16-bit only
    assert ours.get_configs_for_cutlass_fna(q2, q2, q2) == [((8, 8), (8, 8))]
    assert ours.get_configs_for_cutlass_blackwell_fna(q2, q2, q2) == []
    monkeypatch.setattr(probes, "_capability", lambda q: 100)
    assert ours.get_configs_for_cutlass_blackwell_fna(q2, q2, q2) == \
        [cutlass_blackwell.BLACKWELL_FORWARD_TILE_SHAPES[2][0]]
    assert ours.get_bwd_configs_for_cutlass_blackwell_fna(q2, q2, q2) == \
        [cutlass_blackwell.BLACKWELL_BACKWARD_TILE_SHAPES[2][0]]


def test_listed_tiles_are_accepted_as_hints():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 8, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    want = ours.na2d(q, k, v, kernel_size=3)
    for q_tile, kv_tile in ours.get_configs_for_flex_fna(q, k, v):
        got = ours.na2d(q, k, v, kernel_size=3, q_tile_shape=q_tile, kv_tile_shape=kv_tile)
        torch.testing.assert_close(got, want)
