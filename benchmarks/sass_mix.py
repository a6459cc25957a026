"""The instruction mix of disassembled SASS (``nvdisasm -c`` text): whole kernels and hot loops.

Pure text processing, no CUDA: ``kernel_sass.py`` feeds it the disassembly of the package's
cubins, the tests a checked-in snippet.

* ``parse`` reads each function's instructions (address, guard predicate, opcode with its
  modifiers, branch target) and where its labels point.
* ``instruction_class`` sorts an opcode into the classes a kernel change is judged by (``mma``,
  ``ldsm``, ``shared``, ``async_copy``, ``barrier``, ``mufu``, ``float``, ``shuffle``,
  ``convert``, ``integer``, ``predicate``, ``move``, ``branch``, ...).
* ``loops`` finds the loop bodies from the branch structure: a branch to an address at or before
  its own closes the loop that starts at its target.
* ``hot_path`` walks one loop body from its head to its closing branch along the path a steady
  iteration takes: the most ``mma``, then the most ``async_copy`` (the ring's refill), then the
  fewest instructions. In the fused kernels that is the unmasked key tile of a plain call: the
  masked tile's logits, the zero-filled or element-wise copies and the bias are side branches it
  leaves out. Inner loops are walked once (their backward branch is not followed).

Counts are static issue slots (one per instruction, whatever its latency or throughput): what
a change to the loop adds or removes, not how long it takes.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

# Opcode (without modifiers) -> class. Prefix rules below catch the families.
_CLASSES = {
    "HMMA": "mma", "IMMA": "mma", "HGMMA": "mma", "DMMA": "mma", "BMMA": "mma",
    "LDSM": "ldsm", "STSM": "ldsm",
    "LDS": "shared", "STS": "shared", "ATOMS": "shared",
    "LDGSTS": "async_copy", "LDGDEPBAR": "async_copy", "DEPBAR": "async_copy",
    "UBLKCP": "async_copy", "UTMALDG": "async_copy",
    "LDG": "global", "STG": "global", "RED": "global", "ATOMG": "global", "ATOM": "global",
    "LD": "global", "ST": "global", "LDL": "local", "STL": "local",
    "BAR": "barrier", "MEMBAR": "barrier", "SYNCS": "barrier", "ERRBAR": "barrier",
    "MUFU": "mufu",
    "FFMA": "float", "FMUL": "float", "FADD": "float", "FMNMX": "float", "FCHK": "float",
    "FSWZADD": "float", "HFMA2": "float", "HADD2": "float", "HMUL2": "float", "HMNMX2": "float",
    "SHFL": "shuffle",
    "F2FP": "convert", "F2F": "convert", "I2F": "convert", "F2I": "convert", "I2FP": "convert",
    "F2IP": "convert", "FRND": "convert",
    "IMAD": "integer", "IADD3": "integer", "IADD": "integer", "LOP3": "integer",
    "LOP": "integer", "SHF": "integer", "SHL": "integer", "SHR": "integer", "LEA": "integer",
    "IABS": "integer", "VIADD": "integer", "VIMNMX": "integer", "VIADDMNMX": "integer",
    "IMNMX": "integer", "SGXT": "integer", "BMSK": "integer", "POPC": "integer",
    "FLO": "integer", "PRMT": "integer", "IDP": "integer", "BREV": "integer",
    "ISETP": "predicate", "FSETP": "predicate", "FSEL": "predicate", "SEL": "predicate",
    "PLOP3": "predicate", "P2R": "predicate", "R2P": "predicate", "VOTE": "predicate",
    "HSETP2": "predicate", "CSETP": "predicate",
    "MOV": "move", "CS2R": "move", "S2R": "move", "S2UR": "move", "R2UR": "move",
    "LDC": "move", "ULDC": "move", "SHFL.IDX": "shuffle",
    "BRA": "branch", "BRX": "branch", "JMP": "branch", "JMX": "branch", "BSSY": "branch",
    "BSYNC": "branch", "EXIT": "branch", "RET": "branch", "CALL": "branch", "WARPSYNC": "branch",
    "BREAK": "branch", "BPT": "branch", "YIELD": "branch", "KILL": "branch",
    "NOP": "nop",
}

# The order of the classes in tables and records.
CLASSES = ("mma", "ldsm", "shared", "async_copy", "global", "local", "barrier", "mufu", "float",
           "shuffle", "convert", "integer", "predicate", "move", "uniform", "branch", "nop",
           "other")


def instruction_class(opcode: str) -> str:
    """The class of one opcode with its modifiers (``"HMMA.16816.F32.BF16"`` -> ``"mma"``).

    ``IMAD.MOV`` is a move the compiler issues on the integer pipe (``move``); uniform-datapath
    instructions (``UIADD3``, ``UMOV``, ... but ``ULDC`` is a constant load: ``move``) are
    ``uniform``: they issue once per warp off the vector pipes.
    """
    base = opcode.split(".", 1)[0]
    if base == "IMAD" and opcode.startswith("IMAD.MOV"):
        return "move"
    if base in _CLASSES:
        return _CLASSES[base]
    if base.startswith("U") and base not in ("UBLKCP", "UTMALDG"):
        return "uniform"
    return "other"


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: its address, guard (``"@!P0"``, or ``""``), opcode with modifiers,
    operand text, and the label it branches to (``None`` unless a direct branch)."""

    address: int
    guard: str
    opcode: str
    operands: str
    target: str | None = None

    @property
    def cls(self) -> str:
        return instruction_class(self.opcode)

    @property
    def is_branch(self) -> bool:
        return self.opcode.split(".", 1)[0] in ("BRA", "BRX", "JMP", "JMX")

    @property
    def unconditional(self) -> bool:
        """No guard (or ``@PT``) and, for a branch, no predicate operand (``BRA P5, `(...)``)."""
        plain = self.guard in ("", "@PT")
        if self.is_branch and re.match(r"!?U?P[0-6T]\s*,", self.operands):
            return False
        return plain


@dataclass
class Function:
    """One kernel's instructions in address order and its labels (name -> address)."""

    name: str
    instructions: list[Instruction] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)

    def target_address(self, instruction: Instruction) -> int | None:
        return None if instruction.target is None else self.labels.get(instruction.target)


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_LABEL = re.compile(r"^(\.L_x_\d+|\.L_\d+):")
_INSTRUCTION = re.compile(
    r"^\s*/\*([0-9a-fA-F]+)\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)"
    r"\s*([^;]*);")
_TARGET = re.compile(r"`\((\.L_x_\d+|\.L_\d+)\)")


def parse(text: str) -> list[Function]:
    """The functions of ``nvdisasm -c`` output, each with its instructions and labels."""
    functions: list[Function] = []
    current: Function | None = None
    pending: list[str] = []  # labels waiting for the next instruction's address
    for line in text.splitlines():
        section = _SECTION.match(line)
        if section:
            current = Function(section.group(1))
            functions.append(current)
            pending = []
            continue
        if current is None:
            continue
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        address = int(found.group(1), 16)
        for name in pending:
            current.labels[name] = address
        pending = []
        operands = found.group(4).strip()
        target = _TARGET.search(operands)
        current.instructions.append(Instruction(address, (found.group(2) or "").strip(),
                                                found.group(3), operands,
                                                target.group(1) if target else None))
    return functions


def mix(instructions) -> dict[str, int]:
    """Instructions per class (every class of ``CLASSES``, zeros included) and ``total``."""
    counts = Counter(i.cls for i in instructions)
    found = {name: counts.get(name, 0) for name in CLASSES}
    found["total"] = sum(counts.values())
    return found


@dataclass(frozen=True)
class Loop:
    """A loop body: the instructions from ``start`` (the head, a backward branch's target) to
    ``end`` (that branch), both addresses inclusive."""

    start: int
    end: int

    def body(self, function: Function) -> list[Instruction]:
        return [i for i in function.instructions if self.start <= i.address <= self.end]


def loops(function: Function) -> list[Loop]:
    """Every loop of ``function`` (one per backward branch; a head closed by several branches
    counts once, up to its last one), outermost first."""
    ends: dict[int, int] = {}
    for instruction in function.instructions:
        target = function.target_address(instruction)
        if target is not None and target <= instruction.address:
            ends[target] = max(ends.get(target, target), instruction.address)
    found = [Loop(start, end) for start, end in ends.items()]
    return sorted(found, key=lambda loop: (loop.start, -loop.end))


def _blocks(body: list[Instruction], function: Function) -> list[list[Instruction]]:
    """``body`` cut into basic blocks: a block starts at a label's address or after a branch
    or ``EXIT``."""
    starts = set(function.labels.values())
    blocks: list[list[Instruction]] = []
    for instruction in body:
        if not blocks or instruction.address in starts or (
                blocks[-1][-1].is_branch or blocks[-1][-1].opcode.startswith("EXIT")):
            blocks.append([])
        blocks[-1].append(instruction)
    return blocks


def steady_score(counts: Counter) -> tuple[int, ...]:
    """The steady path: most ``mma``, then most ``async_copy``, then fewest instructions (the
    unmasked, fully copied tile of a plain call)."""
    return (counts["mma"], counts["async_copy"], -sum(counts.values()))


def masked_score(counts: Counter) -> tuple[int, ...]:
    """The masked path of a plain call: most ``mma`` and ``async_copy``, no bias gather (global
    loads) and no softcap (its tanh is MUFU beside the exponentials), then the most
    instructions (the mask's own)."""
    return (counts["mma"], counts["async_copy"], -counts["global"], -counts["mufu"],
            sum(counts.values()))


def hot_path(function: Function, loop: Loop, score=steady_score) -> list[Instruction]:
    """The instructions of one iteration along the path through ``loop`` that ``score`` ranks
    highest (by default the steady path), from its head to its closing branch.

    Forward branches inside the body are the choices; a branch out of the body or backward (an
    inner loop's) is not followed, so an inner loop's body counts once.
    """
    blocks = _blocks(loop.body(function), function)
    first = {block[0].address: n for n, block in enumerate(blocks)}
    best: list[tuple[tuple[int, ...], Counter, list[int]] | None] = [None] * len(blocks)
    best[0] = (score(Counter()), Counter(), [])
    for n, block in enumerate(blocks):
        reached = best[n]
        if reached is None:
            continue
        counts = reached[1] + Counter(i.cls for i in block)
        here = (score(counts), counts, reached[2] + [n])
        last = block[-1]
        if last.address == loop.end:
            best[n] = here  # the closing branch: the iteration ends here
            continue
        successors = []
        target = function.target_address(last) if last.is_branch else None
        if target is not None and target > last.address and target in first:
            successors.append(first[target])
        ends_flow = (last.is_branch and last.unconditional) or (
            last.opcode.startswith("EXIT") and last.unconditional)
        if not ends_flow and n + 1 < len(blocks):
            successors.append(n + 1)
        for m in successors:
            known = best[m]
            if known is None or here[0] > known[0]:
                best[m] = here
    (closing,) = [n for n, block in enumerate(blocks) if block[-1].address == loop.end]
    found = best[closing]
    if found is None:
        return []
    return [i for n in found[2] for i in blocks[n]]
