"""Translate the kernels' inline-PTX ``asm`` statements into calls of ``ptx.h``'s emulations.

A statement ``asm [volatile] ("<template>" : outputs : inputs [: clobbers]);`` is parsed (string
literals concatenated, operands ``"<constraint>"(<expr>)`` numbered outputs first, as in GCC), its
PTX instruction split into an opcode and operands (``%n``, ``{%a, %b, ...}``), and the opcode looked
up in ``INSTRUCTIONS``: the emulating function and, per PTX operand, whether it is a destination.
The statement becomes one call with the operands in PTX order, each destination bound through
``na_emu::ptx::out<'c'>(expr)`` (its type must be the constraint's register type), each source
``na_emu::ptx::in<'c'>(expr)``. An opcode with no emulation becomes a trap that names it, so a path
that is never instantiated still compiles and one that runs fails loudly.
"""

from __future__ import annotations

import re

# opcode -> (C++ function in na_emu::ptx, roles of the PTX operand groups: "d" destination,
# "s" source). A braced group {..} has one role for all its registers.
INSTRUCTIONS = {
    "cvt.f32.f16": ("cvt_f32_f16", "ds"),
    "cvt.f32.bf16": ("cvt_f32_bf16", "ds"),
    "cvt.rn.f16.f32": ("cvt_rn_f16_f32", "ds"),
    "cvt.rn.bf16.f32": ("cvt_rn_bf16_f32", "ds"),
    "cvt.rn.f16x2.f32": ("cvt_rn_f16x2_f32", "dss"),
    "cvt.rn.bf16x2.f32": ("cvt_rn_bf16x2_f32", "dss"),
    "ex2.approx.ftz.f32": ("ex2_approx_ftz_f32", "ds"),
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32":
        ("mma_m16n8k16_f32<na_emu::ptx::kMmaF16>", "dsss"),
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32":
        ("mma_m16n8k16_f32<na_emu::ptx::kMmaBf16>", "dsss"),
    # cp.async: [dst] and [src] are sources (addresses); an optional src-size follows cp-size.
    "cp.async.cg.shared.global": ("cp_async_cg_shared_global", "sss*"),
    "cp.async.ca.shared.global": ("cp_async_ca_shared_global", "sss*"),
    "cp.async.commit_group": ("cp_async_commit_group", ""),
    "cp.async.wait_group": ("cp_async_wait_group", "s"),
    "cp.async.wait_all": ("cp_async_wait_all", ""),
    "ldmatrix.sync.aligned.m8n8.x1.shared.b16": ("ldmatrix_sync_aligned_m8n8_x1_shared_b16", "ds"),
    "ldmatrix.sync.aligned.m8n8.x2.shared.b16": ("ldmatrix_sync_aligned_m8n8_x2_shared_b16", "ds"),
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16": ("ldmatrix_sync_aligned_m8n8_x4_shared_b16", "ds"),
    "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16":
        ("ldmatrix_sync_aligned_m8n8_x2_trans_shared_b16", "ds"),
    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16":
        ("ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16", "ds"),
    # wgmma: the accumulators, then 7 (A in shared memory) or 6 (A in registers) groups.
    **{f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}":
       (f"wgmma_m64k16<{n}, na_emu::ptx::{tag}>", "dssssss*")
       for n in (16, 32, 64, 128) for t, tag in (("f16", "kMmaF16"), ("bf16", "kMmaBf16"))},
    "wgmma.fence.sync.aligned": ("wgmma_fence_sync_aligned", ""),
    "wgmma.commit_group.sync.aligned": ("wgmma_commit_group_sync_aligned", ""),
    "wgmma.wait_group.sync.aligned": ("wgmma_wait_group_sync_aligned", "s"),
    "fence.proxy.async.shared::cta": ("fence_proxy_async_shared_cta", ""),
}
# Constraint letters whose operand is an immediate ("n") or a register of that width.
_IMMEDIATE = "n"

_START = re.compile(r"\basm\s*(?:volatile\s*|__volatile__\s*)?\(")
_OPERAND = re.compile(r'^\s*"([=+&]*)([a-z])"\s*\((.*)\)\s*$', re.DOTALL)


class AsmError(ValueError):
    """An asm statement this translator cannot read."""


def _scan(text: str, start: int, stop_chars: str) -> int:
    """Index of the first of ``stop_chars`` at nesting depth 0 from ``start`` (strings, chars
    and brackets skipped); ``len(text)`` if none."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch in "\"'":
            j = i + 1
            while text[j] != ch:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if depth == 0 and ch in stop_chars:
            # at depth 0 of an asm body ':' only separates sections ("::" is two of them; a
            # C++ scope operator can only occur inside an operand's parentheses)
            return i
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        i += 1
    return len(text)


def _split(text: str, sep: str) -> list[str]:
    parts, i = [], 0
    while True:
        j = _scan(text, i, sep)
        parts.append(text[i:j])
        if j >= len(text):
            return parts
        i = j + 1


def _operands(section: str) -> list[tuple[str, str, str]]:
    """(modifiers, constraint letter, expression) of each operand of a section."""
    out = []
    for part in _split(section, ","):
        if not part.strip():
            continue
        m = _OPERAND.match(part)
        if m is None:
            raise AsmError(f"cannot read asm operand {part.strip()!r}")
        out.append(m.groups())
    return out


def _template(section: str) -> str:
    literals = re.findall(r'"((?:[^"\\]|\\.)*)"', section)
    if not literals or re.sub(r'"((?:[^"\\]|\\.)*)"', "", section).strip():
        raise AsmError(f"asm template is not a string literal: {section.strip()!r}")
    return "".join(literals).replace("\\n", " ").replace("\\t", " ")


def _ptx_groups(operand_text: str) -> list[list[int]]:
    """PTX operands as lists of asm operand numbers: ``%3`` -> [3], ``{%0,%1}`` -> [0, 1],
    ``[%4]`` (an address) -> [4]; an integer literal -> [-value - 1] (passed as is)."""
    groups = []
    if not operand_text.strip():
        return groups
    for op in _split(operand_text, ","):
        op = op.strip()
        if re.fullmatch(r"\d+", op):
            groups.append([-int(op) - 1])
            continue
        if op.startswith("[") and op.endswith("]"):
            op = op[1:-1].strip()
        inner = op[1:-1] if op.startswith("{") and op.endswith("}") else op
        regs = [r.strip() for r in inner.split(",")]
        if not all(re.fullmatch(r"%\d+", r) for r in regs):
            raise AsmError(f"unsupported PTX operand {op!r}")
        groups.append([int(r[1:]) for r in regs])
    return groups


def _predicated(template: str) -> str:
    """A scoped block ``{ .reg .pred p; setp.ne.b32 p, %n, 0; <instruction> }`` (how a kernel
    hands wgmma its scale-d predicate) as the one instruction with ``p`` replaced by ``%n``: the
    emulation receives the integer and tests it against zero. Other blocks come back as they are
    (and become traps)."""
    statements = [s.strip() for s in template.strip()[1:-1].split(";") if s.strip()]
    predicates, rest = {}, []
    for statement in statements:
        declared = re.fullmatch(r"\.reg\s+\.pred\s+(\w+)", statement)
        setp = re.fullmatch(r"setp\.ne\.b32\s+(\w+)\s*,\s*(%\d+)\s*,\s*0", statement)
        if declared:
            predicates[declared.group(1)] = None
        elif setp and setp.group(1) in predicates:
            predicates[setp.group(1)] = setp.group(2)
        else:
            rest.append(statement)
    if len(rest) != 1 or None in predicates.values():
        return template
    opcode, _, operands = rest[0].partition(" ")
    for name, source in predicates.items():
        operands = re.sub(rf"(?<![%\w]){name}\b", source, operands)
    return f"{opcode} {operands}"


def translate(body: str) -> str:
    """The C++ call replacing one statement; ``body`` is the text between ``asm(`` and ``)``."""
    sections = _split(body, ":")
    template = _template(sections[0]).strip()
    outputs = _operands(sections[1]) if len(sections) > 1 else []
    inputs = _operands(sections[2]) if len(sections) > 2 else []
    instruction = _predicated(template) if template.startswith("{") else template
    instruction = instruction.rstrip(";").strip()
    if ";" in instruction or "{" in instruction.split(None, 1)[0]:
        return f'na_emu::trap("unemulated multi-instruction PTX: {_c_string(template)}")'
    opcode, _, rest = instruction.partition(" ")
    if opcode not in INSTRUCTIONS:
        return f'na_emu::trap("unemulated PTX instruction {_c_string(opcode)}")'
    function, roles = INSTRUCTIONS[opcode]
    groups = _ptx_groups(rest)
    optional = roles.endswith("*")
    roles = roles.rstrip("*")
    if not (len(groups) == len(roles) or (optional and len(groups) == len(roles) + 1)):
        raise AsmError(f"{opcode}: {len(groups)} operands, expected {len(roles)}")
    roles += "s" * (len(groups) - len(roles))
    operands = outputs + inputs
    args = []
    for role, group in zip(roles, groups):
        for n in group:
            if n < 0:  # a literal in the template
                args.append(str(-n - 1))
                continue
            if n >= len(operands):
                raise AsmError(f"{opcode}: %{n} names no operand")
            mods, letter, expr = operands[n]
            is_output = n < len(outputs)
            if role == "d":
                if not is_output:
                    raise AsmError(f"{opcode}: destination %{n} is an input operand")
                args.append(f"na_emu::ptx::out<'{letter}'>({expr})")
            else:
                if is_output and "+" not in mods:
                    raise AsmError(f"{opcode}: source %{n} is a write-only output")
                args.append(f"({expr})" if letter in _IMMEDIATE
                            else f"na_emu::ptx::in<'{letter}'>({expr})")
    return f"na_emu::ptx::{function}({', '.join(args)})"


def _c_string(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def rewrite(text: str) -> str:
    """``text`` with every asm statement replaced by its emulation call."""
    out, pos = [], 0
    for m in _START.finditer(text):
        if m.start() < pos:
            continue
        close = _scan(text, m.end(), ")")
        if close >= len(text):
            raise AsmError("unterminated asm statement")
        out.append(text[pos:m.start()])
        out.append(translate(text[m.end():close]))
        pos = close + 1
    out.append(text[pos:])
    return "".join(out)
