"""Theoretical occupancy (fallback_kernels/occupancy.py) and the kernels' compile records.

The arithmetic is checked on cases computed by hand from the CUDA occupancy calculator's rules
(registers per warp in units of 256, per sub-partition; 1 KB reserved shared memory per CTA,
128-byte granules; thread and CTA caps). One real variant is compiled with NVRTC for sm_90 (no
GPU needed) to check that ptxas' static shared memory, the launch's dynamic bytes and the block
size reach the record, also when the cubin comes back from the disk cache.
"""

from __future__ import annotations

import pytest

from cudnn_attn.fallback_kernels import _loader, fused, occupancy


def occ(arch, **kw):
    found = occupancy.occupancy(arch, **kw)
    return found.ctas_per_sm, found.warps_per_sm, found.limiter


def test_register_limited_cases_by_hand():
    # 255 regs -> 8160 -> 8192 per warp; 16384 per sub-partition holds 2 warps: 8 warps, 2 CTAs
    assert occ("sm_90", registers=255, threads=128) == (2, 8, "registers")
    # 168 regs: 5376 per warp exactly, 3 per sub-partition: 12 warps = 3 CTAs of 4 warps
    assert occ("sm_90", registers=168, threads=128) == (3, 12, "registers")
    # 169 regs: 5408 rounds to 5632, 2 per sub-partition (a naive 65536 / (169 * 128) says 3)
    assert occ("sm_90", registers=169, threads=128) == (2, 8, "registers")


def test_shared_memory_limited_cases_by_hand():
    # 70000 + 1024 reserved -> 71040 (128-byte granules): 164 KB holds 2, 228 KB holds 3
    kw = dict(registers=64, threads=128, static_shared=0, dynamic_shared=70000)
    assert occ("sm_80", **kw) == (2, 8, "shared memory")
    assert occ("sm_90", **kw) == (3, 12, "shared memory")
    # the fused bf16 D=128 forward of issue 34: 164 regs, 288 + 92688 bytes -> 2 CTAs, 8 warps
    assert occ("sm_90", registers=164, threads=128, static_shared=288,
               dynamic_shared=92688) == (2, 8, "shared memory")
    # the 1 KB reserve decides: 2 x (116000 + 1024 -> 117120) > 228 KB, 2 x 116000 would fit
    assert occ("sm_90", registers=64, threads=128, dynamic_shared=116000)[0] == 1
    # more than an SM has: nothing fits
    assert occ("sm_80", registers=32, threads=128, dynamic_shared=200 * 1024)[0] == 0


def test_thread_and_slot_limits_by_hand():
    # 32 regs: 1024 per warp, 16 per sub-partition = 64 warps; 256 threads: 8 CTAs by both
    assert occ("sm_90", registers=32, threads=256) == (8, 64, "registers+threads")
    # tiny blocks: 32 CTA slots before 2048 threads
    assert occ("sm_90", registers=16, threads=32) == (32, 32, "CTA slots")
    # sm_86: 1536 threads, 16 slots
    assert occ("sm_86", registers=32, threads=256) == (6, 48, "threads")
    assert occupancy.sm_limits("sm_90a") == occupancy.SM_LIMITS[90]
    assert occupancy.sm_limits("sm_87") == occupancy.SM_LIMITS[86]  # newest listed below
    with pytest.raises(ValueError, match="threads"):
        occupancy.occupancy("sm_90", registers=32, threads=0)
    with pytest.raises(ValueError, match="no SM limits"):
        occupancy.sm_limits("sm_75")


def test_ptxas_static_shared_memory_is_parsed():
    log = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
           "ptxas info    : Used 164 registers, used 1 barriers, 288 bytes smem, 400 bytes cmem[0]\n")
    assert _loader.ptxas_usage(log)["_Z1kv"] == {"registers": 164, "static_smem_bytes": 288}


def test_a_real_variant_records_its_budget_and_a_warm_cache_keeps_it(tmp_path, monkeypatch):
    pytest.importorskip("cupy")
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(tmp_path / "cubins"))
    variant = next(v for v in fused.pipelined_variants()
                   if v.kernel == "na_fused_forward<na_bf16,64>/pipelined")
    import cudnn_attn as ca

    ca.clear_caches()
    first = _loader.compile_variant(variant, fused.PIPELINED_DEFINES, "sm_90")
    record = first.record
    assert record.threads == fused.THREADS == 128
    assert record.dynamic_smem_bytes == fused.smem_bytes("na_fused_forward", *_bf16_64(),
                                                         pipelined=True)
    program = _loader.compile_program(variant.source, fused.PIPELINED_DEFINES,
                                      [variant.expression], "sm_90")
    assert record.static_smem_bytes > 0
    assert f"{record.registers} registers" in program.log
    assert f"{record.static_smem_bytes} bytes smem" in program.log
    expected = occupancy.occupancy("sm_90", registers=record.registers, threads=128,
                                   static_shared=record.static_smem_bytes,
                                   dynamic_shared=record.dynamic_smem_bytes)
    assert (record.ctas_per_sm, record.warps_per_sm) == (expected.ctas_per_sm,
                                                         expected.warps_per_sm)
    assert record["occupancy_limiter"] == expected.limiter
    ca.clear_caches()  # forget the in-memory program: the next build reads the disk cache
    again = _loader.compile_variant(variant, fused.PIPELINED_DEFINES, "sm_90")
    assert again.origin == "disk" and again.record == record


def _bf16_64():
    import torch

    return torch.bfloat16, 64


def test_the_kernels_table_shows_the_budget():
    from cudnn_attn.cli.kernels import budget_table
    from cudnn_attn.fallback_kernels import CompileRecord

    rows = [CompileRecord("k<a>", "sm_90", 168, 0, 0, 0, "k<a>", 288, 70000, 128),
            CompileRecord("k<b>", "sm_80", 40, 0, 0, 0, "k<b>")]
    header, first, second = budget_table(rows).splitlines()
    assert header.split() == ["kernel", "arch", "regs", "spill", "st", "spill", "ld", "smem",
                              "st", "smem", "dyn", "threads", "CTAs/SM", "warps/SM", "limited",
                              "by"]
    assert first.split() == ["k<a>", "sm_90", "168", "0", "0", "288", "70000", "128", "3", "12",
                             "registers+shared", "memory"]
    assert second.split()[-4:] == ["-", "-", "-", "-"]  # no block size declared: no occupancy
