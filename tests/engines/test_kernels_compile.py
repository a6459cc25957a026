"""Every CUDA kernel the package can launch compiles with NVRTC for sm_80 and sm_90, without spills.

No GPU is needed: NVRTC (the nvidia-cuda-nvrtc wheel, loaded through CuPy) compiles to a cubin and
``ptxas -v`` reports registers and spills. These tests are the CPU suite's proof that the kernels
exist as shipped and fit their register budgets; whether they compute the right values is the
job of the GPU-marked tests.

Every kernel, head dim, build and arch compiles; of each fp16/bf16 pair of a variant (one
template, the storage type's conversions and mma type apart: the same registers and spills in
every record of the full sweep) one compiles per arch, the other on the other arch where both
archs have the variant. The plain fused build's fp16/bf16 variants, which a launch takes only
under ``CUDNN_ATTN_FUSED_PIPELINED=0`` (16-bit inputs take the pipelined build on every arch the
kernels support), compile on one arch, ``OPT_OUT_ARCH`` (``sampled_programs``;
``CUDNN_ATTN_FULL_SWEEP=1`` compiles every variant for every arch, and so does
``benchmarks/gpu_proof.py --prebuild`` for the device's).
"""

import re
import time

import pytest
from full_sweep import FULL, pick

from cudnn_attn import fallback_kernels
from cudnn_attn.fallback_kernels import _loader

ARCHS = ("sm_80", "sm_90")
TWINS = ("na_half", "na_bf16")
OPT_OUT_ARCH = "sm_80"  # the cheaper ptxas (sm_90 takes twice as long on the fused kernels)
_ALL_PROGRAMS = fallback_kernels.kernel_programs  # before any test patches it


def opt_out_only(name: str, kernel: str) -> bool:
    """Whether a variant is one of the plain fused build's fp16/bf16 ones (the build a 16-bit
    launch takes only under ``CUDNN_ATTN_FUSED_PIPELINED=0``)."""
    return name == "fused" and _kind(kernel)[1] in TWINS


def sampled_programs(arch: str) -> dict:
    """``kernel_programs(arch)`` with one variant of each fp16/bf16 pair, alternating along the
    pairs (so along the head dims of a kernel) and between the archs; the opt-out build's
    16-bit variants on ``OPT_OUT_ARCH`` only."""
    programs = {}
    for name, variants in _ALL_PROGRAMS(arch).items():
        if arch != OPT_OUT_ARCH and not FULL:
            variants = [v for v in variants if not opt_out_only(name, v.kernel)]
        twins: dict[str, list] = {}
        for variant in variants:
            twins.setdefault(variant.kernel.replace(TWINS[1], TWINS[0]), []).append(variant)
        kept = {v.kernel for i, group in enumerate(twins.values())
                for v in pick(group, i + ARCHS.index(arch))}
        programs[name] = [v for v in variants if v.kernel in kept]
    return programs


@pytest.fixture(scope="module", params=ARCHS)
def records(request):
    # On the tools' thread count: the records a serial build gives (test_compile_all_reports_each_
    # kernel_in_order_whatever_the_threads checks that), in half the time on 2 cores.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fallback_kernels, "kernel_programs", sampled_programs)
        return fallback_kernels.compile_all(request.param, jobs=fallback_kernels.default_jobs())


def _kind(kernel: str) -> tuple[str, str]:
    """(the kernel with its storage type as T, the storage type) of a variant's kernel id."""
    ctype = re.search(r"\b(float|double|na_half|na_bf16)\b", kernel).group(1)
    return re.sub(rf"\b{ctype}\b", "T", kernel), ctype


def _family(kernel: str) -> str:
    """A variant's kernel id without its storage type and head dim."""
    return re.sub(r",\d+>", ">", _kind(kernel)[0])


def test_the_sample_compiles_every_kernel_head_dim_and_type_for_every_arch():
    kept = {}  # (arch, module) -> the kernel ids compiled
    for arch in ARCHS:
        full, sampled = _ALL_PROGRAMS(arch), sampled_programs(arch)
        assert list(sampled) == list(full)
        for name, variants in full.items():
            ids = {v.kernel for v in variants
                   if arch == OPT_OUT_ARCH or FULL or not opt_out_only(name, v.kernel)}
            kept[arch, name] = {v.kernel for v in sampled[name]}
            # every kernel at every head dim (its storage type as T), every fp32/fp64 variant
            assert {_kind(k)[0] for k in kept[arch, name]} == {_kind(k)[0] for k in ids}
            assert {k for k in ids if _kind(k)[1] not in TWINS} <= kept[arch, name] <= ids
            # a kernel of several head dims: in each of its types, at one head dim or another
            for family in {_family(k) for k in ids}:
                if len({_kind(k)[0] for k in ids if _family(k) == family}) > 1:
                    assert ({_kind(k)[1] for k in kept[arch, name] if _family(k) == family}
                            == {_kind(k)[1] for k in ids if _family(k) == family}), family
    for name in set(_ALL_PROGRAMS("sm_80")) & set(_ALL_PROGRAMS("sm_90")):
        # a module both archs compile: each variant on one arch or the other (of the opt-out
        # build's fp16/bf16 pairs, one)
        every = {v.kernel for v in _ALL_PROGRAMS("sm_80")[name]}
        both = kept["sm_80", name] | kept["sm_90", name]
        assert {k for k in every if not opt_out_only(name, k)} <= both <= every
        assert {_kind(k)[0] for k in both} == {_kind(k)[0] for k in every}
    assert any(opt_out_only("fused", k) for k in kept[OPT_OUT_ARCH, "fused"])


def test_every_variant_compiles_with_a_record(records):
    arch = records[0]["arch"]
    # Every module compiling for the arch (the wide forward is sm_90+ only).
    variants = [v for vs in sampled_programs(arch).values() for v in vs]
    assert len(records) == len(variants)
    for wide in ("na_fused_forward_wide<", "na_fused_backward_dq_wide<",
                 "na_fused_forward_wgmma<", "na_fused_forward_wide_wgmma<"):
        assert any(r.kernel.startswith(wide) for r in records) == (arch == "sm_90")
    assert {r.kernel for r in records} == {v.kernel for v in variants}
    for record in records:
        # The wgmma forward compiles for the arch-specific target (sm_90a).
        assert record["arch"] == (f"{arch}a" if "wgmma" in record.kernel else arch)
        assert 0 < record["registers"] <= 255, record


def test_wgmma_kernels_are_not_serialized(records):
    """ptxas serializes wgmma (C7515) or injects waits (C7517) when registers a wgmma in flight
    uses are touched before its wait; it says so in its log (a kernel reading the accumulators
    before the wait shows both)."""
    from cudnn_attn.fallback_kernels import fused_hopper as H

    if records[0]["arch"] != "sm_90":
        assert not any("wgmma" in r.kernel for r in records)
        return
    wgmma = [r for r in records if "wgmma" in r.kernel]
    assert {r.kernel for r in wgmma} == {v.kernel for v in sampled_programs("sm_90")["fused_hopper"]}
    for record in wgmma:  # memoized by compile_all: compiles nothing more
        program = _loader.compile_program(H.SOURCE, H.DEFINES, [record.expression], "sm_90a")
        assert program.cubin[:4] == b"\x7fELF"
        assert "C7515" not in program.log and "C7517" not in program.log, program.log


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


def test_half_kernels_use_tensor_cores(records):
    # mma.sync must be in the fp16/bf16 fused forward; fp32 must not silently use tf32.
    # The program compile_all built for the 16-bit forward at head dim 64 (memoized: compiles
    # nothing more): the plain build's where this arch compiles it, else the pipelined build's.
    module = __import__("cudnn_attn.fallback_kernels.fused" if records[0].arch == OPT_OUT_ARCH
                        else "cudnn_attn.fallback_kernels.fused_pipelined", fromlist=["SOURCE"])
    (expression,) = [r.expression for r in records
                     if re.fullmatch(r"na_fused_forward<na_(half|bf16),64>(/pipelined)?", r.kernel)
                     and ("pipelined" in r.kernel) != (records[0].arch == OPT_OUT_ARCH)]
    program = _loader.compile_program(module.SOURCE, module.DEFINES, [expression],
                                      records[0].arch)
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


def test_cli_kernels_prints_every_record_and_a_line_per_kernel(capsys, monkeypatch):
    import json

    from cudnn_attn.cli import main

    monkeypatch.setattr(fallback_kernels, "kernel_programs", sampled_programs)  # compiled above
    assert main(["kernels", "--arch", "sm_90", "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    expected = fallback_kernels.compile_all("sm_90")
    assert printed == [{k: r[k] for k in r.keys()} for r in expected]
    assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in printed)
    # stderr: one progress line per kernel, counted in order, naming the kernel.
    lines = [line for line in captured.err.splitlines() if line.startswith("kernels [")]
    assert len(lines) == len(expected)
    for done, (line, record) in enumerate(zip(lines, expected), 1):
        assert re.fullmatch(rf"kernels \[{done}/{len(expected)}\] sm_90 {re.escape(record.kernel)} "
                            r"\d+\.\d s( \((memory|disk)\))?", line), line


def test_compile_all_reports_each_kernel_in_order_whatever_the_threads():
    unfused = fallback_kernels.kernel_programs("sm_80")["unfused"]
    seen = []
    serial = fallback_kernels.compile_all("sm_80", programs=["unfused"], jobs=1)
    threaded = fallback_kernels.compile_all(
        "sm_80", programs=["unfused"], jobs=3,
        progress=lambda done, total, build: seen.append((done, total, build.record.kernel,
                                                         build.origin)))
    assert [r.kernel for r in serial] == [v.kernel for v in unfused]
    assert threaded == serial
    assert [s[:3] for s in seen] == [(i, len(unfused), v.kernel)
                                     for i, v in enumerate(unfused, 1)]
    assert {s[3] for s in seen} == {"memory"}  # the serial pass built them in this process


def test_default_jobs_follow_the_cpus_up_to_a_cap(monkeypatch):
    import os

    for cpus, expected in ((1, 1), (2, 2), (64, fallback_kernels.MAX_DEFAULT_JOBS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)),
                            raising=False)
        assert fallback_kernels.default_jobs() == expected


def test_compile_all_rejects_bad_jobs():
    for jobs in (0, -1, 1.5, "2", None, True):
        with pytest.raises(ValueError, match="jobs"):
            fallback_kernels.compile_all("sm_80", jobs=jobs)


def test_a_failing_kernel_stops_compile_all(monkeypatch):
    real = fallback_kernels.compile_variant
    started = []

    def failing(variant, defines, arch):
        started.append(variant.kernel)
        if len(started) == 1:
            raise _loader.KernelCompileError(f"NVRTC could not compile {variant.kernel}")
        time.sleep(0.2)  # the others take a while, as compiles do
        return real(variant, defines, arch)

    monkeypatch.setattr(fallback_kernels, "compile_variant", failing)
    for jobs in (1, 2):
        started.clear()
        with pytest.raises(_loader.KernelCompileError, match="could not compile"):
            fallback_kernels.compile_all("sm_80", programs=["unfused"], jobs=jobs)
        # The kernels not yet started when the first failed are not compiled.
        assert len(started) <= jobs + 1 < len(fallback_kernels.kernel_programs("sm_80")["unfused"])
