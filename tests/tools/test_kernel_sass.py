"""benchmarks/sass_mix.py and kernel_sass.py's pure parts on a checked-in SASS snippet
(tests/tools/data/loop.sass: a key loop with an inner copy loop, a masked side branch and a
conditional exit, written in nvdisasm's layout). No disassembler, no NVRTC."""

import struct
from pathlib import Path

import pytest
from common import load_benchmark

SNIPPET = Path(__file__).parent / "data" / "loop.sass"


@pytest.fixture(scope="module")
def sass():
    return load_benchmark("sass_mix")


@pytest.fixture(scope="module")
def toy(sass):
    (function,) = sass.parse(SNIPPET.read_text())
    return function


def test_parse_reads_instructions_guards_and_labels(toy):
    assert toy.name == "toy"
    assert len(toy.instructions) == 34
    assert toy.labels[".L_x_4"] == 0x30 and toy.labels[".L_x_3"] == 0x200
    branch = next(i for i in toy.instructions if i.address == 0x50)
    assert (branch.guard, branch.opcode, branch.target) == ("@P0", "BRA", ".L_x_0")
    assert not branch.unconditional
    two_predicates = next(i for i in toy.instructions if i.address == 0x1E0)
    assert two_predicates.target == ".L_x_3" and not two_predicates.unconditional


@pytest.mark.parametrize("opcode, cls", [
    ("HMMA.16816.F32.BF16", "mma"), ("LDSM.16.MT88.4", "ldsm"), ("LDGSTS.E.BYPASS.128", "async_copy"),
    ("MUFU.EX2", "mufu"), ("FMNMX", "float"), ("SHFL.BFLY", "shuffle"),
    ("F2FP.BF16.F32.PACK_AB", "convert"), ("IMAD.WIDE.U32", "integer"), ("IMAD.MOV.U32", "move"),
    ("FSEL", "predicate"), ("UIADD3", "uniform"), ("ULDC.64", "move"), ("BSSY", "branch"),
    ("BAR.SYNC.DEFER_BLOCKING", "barrier"), ("QSPC", "other")])
def test_instruction_classes(sass, opcode, cls):
    assert sass.instruction_class(opcode) == cls


def test_loops_are_closed_by_backward_branches(sass, toy):
    found = [(loop.start, loop.end) for loop in sass.loops(toy)]
    assert found == [(0x30, 0x1D0), (0x60, 0xA0), (0x210, 0x210)]


def test_hot_path_takes_the_copy_and_skips_the_mask(sass, toy):
    outer = sass.loops(toy)[0]
    path = sass.hot_path(toy, outer)
    addresses = [i.address for i in path]
    assert addresses[0] == 0x30 and addresses[-1] == 0x1D0
    assert 0x70 in addresses  # the inner loop's LDGSTS, walked once
    assert not {0x100, 0x110, 0x120} & set(addresses)  # the masked side branch
    counts = sass.mix(path)
    assert counts["total"] == 24 == len(path)
    assert (counts["mma"], counts["async_copy"], counts["ldsm"], counts["mufu"]) == (3, 2, 2, 1)
    assert counts["predicate"] == 3 and counts["branch"] == 4
    assert sum(counts[c] for c in sass.CLASSES) == counts["total"]


def test_masked_path_takes_the_mask_branch(sass, toy):
    outer = sass.loops(toy)[0]
    steady = sass.hot_path(toy, outer)
    masked = sass.hot_path(toy, outer, sass.masked_score)
    extra = {i.address for i in masked} - {i.address for i in steady}
    assert extra == {0x100, 0x110, 0x120}  # the side branch's compare and two selects
    assert sass.mix(masked)["mma"] == sass.mix(steady)["mma"] == 3


def test_whole_kernel_mix_counts_every_instruction(sass, toy):
    counts = sass.mix(toy.instructions)
    assert counts["total"] == 34 and counts["mma"] == 3 and counts["global"] == 1


def _elf_header(phoff, phnum, shoff, shnum) -> bytes:
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", header, 0x20, phoff, shoff)
    struct.pack_into("<HHHH", header, 0x36, 56, phnum, 64, shnum)
    return bytes(header)


def test_complete_elf_restores_the_byte_cupy_drops():
    kernel_sass = load_benchmark("kernel_sass")
    whole = _elf_header(phoff=200, phnum=2, shoff=64, shnum=2) + b"\1" * (312 - 64)
    assert len(whole) == 312
    assert kernel_sass.complete_elf(whole[:-1]) == whole[:-1] + b"\0"
    assert kernel_sass.complete_elf(whole) == whole
    with pytest.raises(ValueError, match="ELF"):
        kernel_sass.complete_elf(b"not an elf" * 8)


def test_missing_disassembler_is_one_clear_line(monkeypatch, tmp_path):
    kernel_sass = load_benchmark("kernel_sass")
    monkeypatch.delenv("CUDNN_ATTN_NVDISASM", raising=False)
    with pytest.raises(SystemExit, match="no nvdisasm .*pip install --no-deps"):
        kernel_sass.find_nvdisasm(str(tmp_path / "nvdisasm"))
