"""CPU: the pure-Python side of the unfused NA kernels (``fallback_kernels.unfused``).

The geometry table (``cudnn_attn.model.geometry``) must match ``common.cu``'s ``NaAxis`` record field for field, the launch grid
must cover every element, the variant list must name every instance, every instance must compile
for sm_80 and sm_90 with NVRTC without spilling, and the launchers must refuse bad input before
touching CUDA.
"""

import re
from importlib import resources

import pytest
import torch

from cudnn_attn.fallback_kernels import _loader
from cudnn_attn.model import geometry
from cudnn_attn.fallback_kernels import unfused as U


def _common_cu() -> str:
    return resources.files("cudnn_attn.fallback_kernels").joinpath("common.cu").read_text()


def test_axis_fields_follow_common_cu():
    body = re.search(r"struct NaAxis \{(.*?)\};", _common_cu(), re.DOTALL).group(1)
    fields = tuple(re.findall(r"int (\w+);", body))
    assert fields == geometry.AXIS_FIELD_NAMES
    assert re.search(r"#define NA_AXIS_FIELDS (\d+)", _common_cu()).group(1) == str(len(fields))
    assert re.search(r"#define NA_MAX_AXES (\d+)", _common_cu()).group(1) == str(geometry.MAX_AXES)
    assert "#define NA_AXIS_NEIGHBORHOOD 0" in _common_cu()
    assert "#define NA_AXIS_BAND 1" in _common_cu()


def _records(table):
    n = len(geometry.AXIS_FIELD_NAMES)
    assert len(table) == 3 * n
    return [dict(zip(geometry.AXIS_FIELD_NAMES, table[a * n:(a + 1) * n])) for a in range(3)]


def test_stride1_table_1d():
    a0, a1, a2 = _records(U.stride1_table((8,), (3,), (2,), (True,)))
    # left/right/offset are band fields; neighborhood axes carry the band defaults (ignored).
    assert a0 == {"mode": 0, "len_q": 8, "len_kv": 8, "kernel": 3, "stride": 1, "dilation": 2, "causal": 1, "left": -1,
                  "right": -1, "offset": 0}
    unused = {"mode": 1, "len_q": 1, "len_kv": 1, "kernel": 1, "stride": 1, "dilation": 1, "causal": 0, "left": -1,
                  "right": -1, "offset": 0}
    assert a1 == unused and a2 == unused


def test_stride1_table_3d_per_axis():
    recs = _records(U.stride1_table((5, 6, 7), (3, 4, 5), (1, 1, 1), (False, True, False)))
    assert [r["mode"] for r in recs] == [0, 0, 0]
    assert [r["len_q"] for r in recs] == [5, 6, 7] == [r["len_kv"] for r in recs]
    assert [r["kernel"] for r in recs] == [3, 4, 5]
    assert [r["causal"] for r in recs] == [0, 1, 0]
    assert all(r["stride"] == 1 for r in recs)


def test_stride1_table_rank_error():
    with pytest.raises(ValueError, match="kernel_size"):
        U.stride1_table((2, 2, 2, 2), (2, 2, 2, 2), (1,) * 4, (False,) * 4)


def test_rpb_shape():
    assert U.rpb_shape(4, (3, 5)) == (4, 5, 9)
    assert U.rpb_shape(1, (7,)) == (1, 13)


@pytest.mark.parametrize("per_head,bh", [(1, 1), (255, 3), (256, 3), (257, 70000),
                                         (U.THREADS * U.MAX_BLOCKS * 3, 5)])
def test_launch_grid_covers_and_is_capped(per_head, bh):
    gx, gy = U.launch_grid(per_head, bh)
    assert 1 <= gx <= U.MAX_BLOCKS and 1 <= gy <= U.MAX_GRID_Y
    if per_head <= U.THREADS * U.MAX_BLOCKS:
        assert (gx - 1) * U.THREADS < per_head <= gx * U.THREADS  # no idle block, none missing
    assert gy == min(bh, U.MAX_GRID_Y)


def test_launch_grid_empty():
    assert U.launch_grid(0, 4) == (0, 0)
    assert U.launch_grid(10, 0) == (0, 0)


def test_variants_name_every_instance():
    vs = U.variants()
    assert len(vs) == 16 == len({v.expression for v in vs}) == len({v.kernel for v in vs})
    assert all(v.source == U.SOURCE for v in vs)
    for kernel in ("na_neighbor_dot", "na_neighbor_gather", "na_inverse_gather",
                   "na_rpb_backward"):
        for ctype in ("double", "float", "na_half", "na_bf16"):
            assert any(v.expression == f"{kernel}<{ctype}>" for v in vs)
    assert U.DEFINES["NA_RPB_THREADS"] & (U.DEFINES["NA_RPB_THREADS"] - 1) == 0


def test_source_has_no_include():
    text = resources.files("cudnn_attn.fallback_kernels").joinpath(U.SOURCE).read_text()
    assert "#include" not in text


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_variant_compiles_without_spills(arch):
    # Each variant its own NVRTC program, as the loader launches them.
    records = [_loader.compile_variant(v, U.DEFINES, arch).record for v in U.variants()]
    assert len(records) == len(U.variants())
    for r in records:
        assert r.arch == arch
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert 0 < r.registers <= 255, r


def _cpu(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def test_launchers_refuse_cpu_tensors_naming_them():
    q = _cpu(1, 1, 8, 4)
    with pytest.raises(ValueError, match="query"):
        U.qk_forward(q, q, None, (3,), (1,), (False,))
    with pytest.raises(ValueError, match="query"):
        U.qk_backward(_cpu(1, 1, 8, 3), q, q, (3,), (1,), (False,), False)
    with pytest.raises(ValueError, match="value"):
        U.av_forward(_cpu(1, 1, 8, 3), q, (3,), (1,), (False,))
    with pytest.raises(ValueError, match="value"):
        U.av_backward(q, _cpu(1, 1, 8, 3), q, (3,), (1,), (False,))


def test_launchers_refuse_bad_kernel_size_and_types():
    q = _cpu(1, 1, 8, 4)
    with pytest.raises(ValueError, match="kernel_size"):
        U.qk_forward(q, q, None, (), (), ())
    with pytest.raises(ValueError, match="kernel_size"):
        U.qk_forward(q, q, None, 3, 1, False)
    with pytest.raises(TypeError, match="query"):
        U.qk_forward(q.numpy(), q, None, (3,), (1,), (False,))


def test_geometry_checks():
    with pytest.raises(ValueError, match=r"kernel_size\[0\] \* dilation\[0\]"):
        U._check_geometry((8,), (3,), (3,), (False,))
    with pytest.raises(ValueError, match=r"dilation\[1\]"):
        U._check_geometry((8, 8), (3, 3), (1, 0), (False, False))
    with pytest.raises(ValueError, match="is_causal"):
        U._check_geometry((8, 8), (3, 3), (1, 1), (False,))
    U._check_geometry((8, 9), (2, 9), (4, 1), (True, False))  # k*d == L is allowed
