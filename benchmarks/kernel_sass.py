"""The SASS instruction mix of the fused kernels, without a GPU: NVRTC compiles each variant's
cubin (as the package does), NVIDIA's ``nvdisasm`` disassembles it, ``sass_mix`` counts.

For every kernel variant of ``--arch`` (filtered by ``--kernel`` / ``--dtype`` / ``--head-dim``):
(the fused kernels that run mma) the instruction classes of the whole kernel and of its hot loop (the loop with the most mma; in
the query-major kernels the key-tile loop, in the key-major one the query-tile loop) along the
steady path of one iteration (``sass_mix.hot_path``: the unmasked, fully copied tile of a plain
call). An inner loop of the hot loop holding the ring's cp.async copies (one piece of K and one
of V per trip) is counted as often as the step needs: ``2 * rows * head_dim / 8 / 128`` pieces
per thread. Per iteration the table shows the mma share of the issue slots, instructions per
mma, and per 16 x 64 block of scores (1024 elements: one key tile of one warp's 16 rows) the
non-mma instructions and the exponentials (MUFU), shuffles, conversions, integer, predicate and
branch instructions; ``mask+/blk``: what the masked path of a plain call (``sass_mix.masked_score``:
no softcap, no bias) adds per block over the steady one. Counts are static issue slots, not
time: a GPU profile (ncu) says what they cost.

The disassembler is a development tool fetched on demand, not a dependency of the package::

    pip install --no-deps --target /tmp/nvdisasm "nvidia-cuda-nvdisasm==13.*"
    python benchmarks/kernel_sass.py --nvdisasm /tmp/nvdisasm/nvidia/cu13/bin/nvdisasm \\
        --arch sm_90 --dtype bf16 --kernel forward

(``--nvdisasm`` defaults to ``$CUDNN_ATTN_NVDISASM``, then ``nvdisasm`` on the PATH.) NVRTC 12.9
and 13.x cubins both disassemble (the counts follow the installed NVRTC's ptxas; the record
names it). Prints a table, writes ``benchmarks/results/kernel_sass[-LABEL]-<date>.json``; ``--compare
FILE`` adds each row's change against an earlier record, ``--dump DIR`` keeps the disassembly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _report  # benchmarks/_report.py (this script's folder is on sys.path)
import sass_mix

_report.unshadow_cudnn()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cudnn_attn import fallback_kernels  # noqa: E402
from cudnn_attn.fallback_kernels import _loader  # noqa: E402

# mma (m16n8k16) per 16 x 64 score block and head dim: each of the kernel's GEMMs of a tile has
# rows x keys x head_dim multiply-adds, 2048 per mma.
GEMMS = {"na_fused_forward": 2, "na_fused_forward_wide": 2, "na_fused_backward_dq": 3,
         "na_fused_backward_dkdv": 4}
BLOCK = 16 * 64
THREADS = 128
SHORT = {"na_half": "fp16", "na_bf16": "bf16", "float": "fp32", "__half": "fp16",
         "__nv_bfloat16": "bf16"}
PER_BLOCK = ("mufu", "shuffle", "convert", "integer", "predicate", "move", "branch", "float",
             "ldsm", "shared")


def complete_elf(cubin: bytes) -> bytes:
    """``cubin`` padded with zeros to the length its ELF header declares. CuPy's
    ``nvrtc.getCUBIN`` returns the image less its last byte (it treats it as a C string), which
    ``nvdisasm`` refuses as "an invalid ELF file"; the driver loads either."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF image")
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" * max(0, size - len(cubin))


def find_nvdisasm(given: str | None) -> str:
    path = given or os.environ.get("CUDNN_ATTN_NVDISASM") or shutil.which("nvdisasm")
    if not path or not Path(path).is_file():
        raise SystemExit(
            f"kernel_sass: no nvdisasm ({path or 'not on PATH'}); fetch it with: pip install "
            "--no-deps --target /tmp/nvdisasm 'nvidia-cuda-nvdisasm==13.*' and pass --nvdisasm "
            "/tmp/nvdisasm/nvidia/cu13/bin/nvdisasm")
    return path


def disassemble(nvdisasm: str, cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as folder:
        image = Path(folder) / "kernel.cubin"
        image.write_bytes(complete_elf(cubin))
        done = subprocess.run([nvdisasm, "-c", str(image)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {done.stderr.strip()}")
    return done.stdout


def variant_facts(variant) -> dict:
    """Kernel family, dtype and head dim from the variant's expression."""
    family, args = variant.expression.split("<", 1)
    ctype, *head_dim = (a.strip() for a in args.rstrip(">").split(","))
    return {"family": family, "dtype": SHORT.get(ctype, ctype),
            "head_dim": int(head_dim[0]) if head_dim else None,
            "build": ("wgmma" if "_wgmma<" in variant.kernel else
                      "pipelined" if variant.kernel.endswith("/pipelined") else "plain")}


def step_rows(family: str, head_dim: int) -> int:
    """Rows of K and V (or Q and dO) the ring copies per loop iteration (NaWide's KSTEP: half a
    key tile for the wide forward at head dim 128, else a whole 64-slot tile)."""
    return 32 if family == "na_fused_forward_wide" and head_dim >= 128 else 64


def hot_loop(function: sass_mix.Function, facts: dict) -> dict | None:
    """The loop with the most mma, its steady iteration's mix and per-block figures."""
    found = [(sass_mix.mix(loop.body(function)), loop) for loop in sass_mix.loops(function)]
    found = [(m, loop) for m, loop in found if m["mma"]]
    if not found:
        return None
    static, loop = max(found, key=lambda f: (f[0]["mma"], -f[0]["total"]))
    path = sass_mix.hot_path(function, loop)
    steady = sass_mix.mix(path)
    inner = []
    for other in sass_mix.loops(function):
        if other == loop or not (loop.start <= other.start and other.end <= loop.end):
            continue
        once = sass_mix.mix(sass_mix.hot_path(function, other))
        trips = None
        if once["async_copy"] and facts["build"] in ("pipelined", "wgmma"):
            pieces = 2 * step_rows(facts["family"], facts["head_dim"]) * facts["head_dim"] // 8
            trips = max(1, pieces // THREADS // once["async_copy"])
            for name in steady:
                steady[name] += (trips - 1) * once[name]
        inner.append({"start": other.start, "end": other.end, "mix": once, "trips": trips})
    # The masked tile's path, copies counted once (the steady path's inner trips aside): the
    # difference from the steady path is the mask's cost.
    masked = sass_mix.mix(sass_mix.hot_path(function, loop, sass_mix.masked_score))
    row: dict[str, Any] = {"loop": [loop.start, loop.end], "static": static, "steady": steady,
                           "masked": masked, "inner": inner}
    gemms = GEMMS.get(facts["family"])
    if gemms and steady["mma"]:
        blocks = steady["mma"] * 2048 / (gemms * facts["head_dim"]) / BLOCK
        if facts["build"] == "wgmma":  # one HGMMA is a whole m64 product: count the warp's rows
            m_tiles = 2 if facts["family"] == "na_fused_forward_wide" else 1
            if facts["family"] == "na_fused_backward_dkdv":  # its query step
                other_side = 32 if facts["head_dim"] >= 128 else 64
            else:
                other_side = step_rows(facts["family"], facts["head_dim"])
            blocks = m_tiles * 16 * other_side / BLOCK
        non_mma = steady["total"] - steady["mma"]
        row.update(mma_share=steady["mma"] / steady["total"],
                   per_mma=steady["total"] / steady["mma"],
                   blocks=blocks, other_per_block=non_mma / blocks,
                   masked_extra_per_block=(masked["total"] - sass_mix.mix(path)["total"]) / blocks,
                   per_block={name: steady[name] / blocks for name in PER_BLOCK})
    return row


def kernel_rows(arch: str, nvdisasm: str, want, dump: Path | None) -> list[dict]:
    rows = []
    for module, variants in fallback_kernels.kernel_programs(arch).items():
        defines = importlib.import_module(f"cudnn_attn.fallback_kernels.{module}").DEFINES
        for variant in variants:
            facts = variant_facts(variant)
            if not want(variant, facts):
                continue
            program = _loader.compile_program(variant.source, defines, [variant.expression],
                                              fallback_kernels.target_arch(module, arch))
            (record,) = _loader.compile_records(program, [variant])
            text = disassemble(nvdisasm, program.cubin)
            if dump is not None:
                name = "".join(ch if ch.isalnum() else "_" for ch in variant.kernel)
                (dump / f"{arch}-{name}.sass").write_text(text)
            (function,) = [f for f in sass_mix.parse(text)
                           if f.name == program.lowered[variant.expression]]
            rows.append({"kernel": variant.kernel, "arch": arch, **facts,
                         "registers": record.registers, "spill_stores": record.spill_stores,
                         "ctas_per_sm": record.ctas_per_sm,
                         "whole": sass_mix.mix(function.instructions),
                         "hot": hot_loop(function, facts)})
    return rows


def table_row(row: dict, before: dict | None) -> dict:
    hot = row["hot"] or {}
    per = hot.get("per_block", {})
    cells = {"kernel": row["kernel"].replace("/pipelined", "/p"), "regs": row["registers"],
             "ctas": row.get("ctas_per_sm"),
             "instr": row["whole"]["total"], "loop": hot.get("steady", {}).get("total"),
             "mma": hot.get("steady", {}).get("mma"), "mma%": 100 * hot.get("mma_share", 0),
             "/mma": hot.get("per_mma"), "other/blk": hot.get("other_per_block"),
             "mask+/blk": hot.get("masked_extra_per_block"),
             **{f"{k}/blk": per.get(k) for k in ("mufu", "shuffle", "convert", "integer",
                                                 "predicate", "branch")}}
    if before and before.get("hot") and hot:
        cells["Δother/blk"] = hot["other_per_block"] - before["hot"]["other_per_block"]
        cells["Δregs"] = row["registers"] - before["registers"]
    return cells


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--kernel", action="append", default=[],
                        help="substring of the variant name (repeatable; default every one)")
    parser.add_argument("--dtype", action="append", default=[], choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--head-dim", action="append", type=int, default=[])
    parser.add_argument("--build", choices=["plain", "pipelined", "wgmma"], default=None,
                        help="only this build (pipelined: the sm_80+ fp16/bf16 kernels)")
    parser.add_argument("--nvdisasm", default=None)
    parser.add_argument("--dump", type=Path, default=None, help="keep each .sass here")
    parser.add_argument("--compare", type=Path, default=None,
                        help="an earlier kernel_sass JSON: show the change per row")
    parser.add_argument("--label", default=None, help="a name for this record (e.g. 'before')")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    nvdisasm = find_nvdisasm(args.nvdisasm)
    if args.dump is not None:
        args.dump.mkdir(parents=True, exist_ok=True)

    def want(variant, facts) -> bool:
        return ((not args.kernel or any(k in variant.kernel for k in args.kernel))
                and (not args.dtype or facts["dtype"] in args.dtype)
                and (not args.head_dim or facts["head_dim"] in args.head_dim)
                and (not args.build or facts["build"] == args.build)
                and facts["family"] in GEMMS)

    rows = kernel_rows(args.arch, nvdisasm, want, args.dump)
    before = {}
    if args.compare is not None:
        before = {r["kernel"]: r for r in json.loads(args.compare.read_text())["rows"]}
    cells = [table_row(r, before.get(r["kernel"])) for r in rows]
    columns = list(dict.fromkeys(k for c in cells for k in c))
    _report.print_table(cells, columns)
    if not args.no_json:
        from cupy.cuda import nvrtc

        suite = "kernel_sass" + (f"-{args.label}" if args.label else "")
        path = _report.write_json(suite, {
            "label": args.label, "arch": args.arch, "nvrtc": ".".join(map(str, nvrtc.getVersion())),
            "nvdisasm": subprocess.run([nvdisasm, "--version"], capture_output=True,
                                       text=True).stdout.strip().splitlines()[-1],
            "compare": str(args.compare) if args.compare else None,
            "rows": rows, "table": cells})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
