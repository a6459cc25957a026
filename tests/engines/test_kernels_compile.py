"""Every CUDA kernel the package can launch compiles with NVRTC for sm_80 and sm_90, without spills.

No GPU is needed: NVRTC (the nvidia-cuda-nvrtc wheel, loaded through CuPy) compiles to a cubin and
``ptxas -v`` reports registers and spills. These tests are the CPU suite's proof that the kernels
exist as shipped and fit their register budgets; whether they compute the right values is the
job of the GPU-marked tests.
"""

import re

import pytest

from cudnn_attn import fallback_kernels
from cudnn_attn.fallback_kernels import _loader

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module", params=ARCHS)
def records(request):
    return fallback_kernels.compile_all(request.param)


def test_every_variant_compiles_with_a_record(records):
    variants = [v for vs in fallback_kernels.kernel_variants().values() for v in vs]
    assert len(records) == len(variants)
    assert {r.kernel for r in records} == {v.kernel for v in variants}
    for record in records:
        assert record["arch"] in ARCHS
        assert 0 < record["registers"] <= 255, record


def test_no_variant_spills(records):
    spilling = [(r.kernel, r.arch, r.spill_stores, r.spill_loads) for r in records
                if r.spill_stores or r.spill_loads]
    assert spilling == []


def test_fused_kernels_cover_every_dtype_and_direction():
    kernels = {v.kernel for v in fallback_kernels.kernel_variants()["fused"]}
    text = " ".join(sorted(kernels))
    for dtype in ("float", "half", "bf16"):
        assert dtype in text
    for direction in ("forward", "dq", "dkdv"):
        assert direction in text


def test_unfused_kernels_include_double():
    expressions = [v.expression for v in fallback_kernels.kernel_variants()["unfused"]]
    assert any("double" in e for e in expressions)


def test_half_kernels_use_tensor_cores():
    # mma.sync must be in the fp16/bf16 fused forward; fp32 must not silently use tf32.
    fused = fallback_kernels.kernel_variants()["fused"]
    module = __import__("cudnn_attn.fallback_kernels.fused", fromlist=["SOURCE"])
    program = _loader.compile_program(module.SOURCE, module.DEFINES,
                                      [v.expression for v in fused], "sm_90")
    text = _loader.source_text(module.SOURCE, module.DEFINES)
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", text)
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", text)
    assert not re.search(r"mma[^\n]*tf32", text)
    assert program.cubin[:4] == b"\x7fELF"


def test_ptxas_log_parsing_is_exact():
    log = (
        "ptxas info    : Compiling entry function '_Z1kIfEvPT_' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kIfEvPT_\n"
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 380 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function '_Z1kIdEvPT_' for 'sm_90'\n"
        "ptxas info    : Used 12 registers, used 0 barriers\n"
    )
    usage = _loader.ptxas_usage(log)
    assert usage["_Z1kIfEvPT_"] == {"stack_bytes": 16, "spill_stores": 8, "spill_loads": 4,
                                    "registers": 40}
    assert usage["_Z1kIdEvPT_"] == {"registers": 12}


def test_sources_are_prefixed_by_defines_and_common():
    text = _loader.source_text("unfused.cu", {"NA_TEST_VALUE": 7})
    assert text.startswith("#define NA_TEST_VALUE 7\n")
    assert text.index("struct NaAxis") < text.index('#line 1 "unfused.cu"')


def test_compile_errors_carry_the_nvrtc_log(tmp_path, monkeypatch):
    original = _loader._read
    monkeypatch.setattr(_loader, "_read", lambda name: "this is not C++;" if name == "bad.cu"
                        else original(name))
    with pytest.raises(_loader.KernelCompileError, match="bad.cu"):
        _loader.compile_program("bad.cu", {}, [], "sm_90")


def test_compile_all_rejects_a_bad_arch():
    with pytest.raises(ValueError, match="arch"):
        fallback_kernels.compile_all("hopper")


def test_cli_kernels_prints_every_record(capsys):
    import json

    from cudnn_attn.cli import main

    assert main(["kernels", "--arch", "sm_90", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {r["kernel"] for r in printed} == {r.kernel for r in fallback_kernels.compile_all("sm_90")}
    assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in printed)
