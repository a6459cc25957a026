"""CPU: the 16-bit emulation catches broken tensor-core code.

Each mutation is a string replacement in a COPY of the fused kernel's source text (exactly what
NVRTC would compile, ``_loader.source_text``), compiled for the host; the same oracle comparison
that ``test_emulation_16bit.py`` passes must then fail. The unmutated text passes it (that test).

* swapped fragment registers: A registers 1 and 2 (rows g+8 / columns +8) exchanged at the mma;
* wrong lane mapping: the fragment code of ``na_mma_abt`` and ``na_mma_pb`` with group and
  thread-in-group taken from the wrong lane bits (g = lane & 7, t = lane >> 3: same ranges, no stray memory);
* wrong bf16 rounding: the f32 -> bf16 store conversion truncating instead of rounding to
  nearest even (its error is below one ulp; the rounding-bias rule catches it);
* in the sm_80+ pipelined build: a key tile read before its cp.async group was waited for,
  ldmatrix row addresses taken from the wrong lanes, the one barrier per step of the forward's and
  dK/dV's rings removed (caught with copies landing at once), and every kernel skipping the mask
  on every tile (the whole-tile tests bypassed); the same two for the wide forward and the wide
  dQ (128-query boxes) and the wide dK/dV (128-key boxes), whose backward mutations must show
  in that kernel's outputs alone; and the ring's copy of a whole box reading the wrong token's
  row;
* in the Hopper forwards (wgmma): K/V/Q stored without the 128-byte swizzle the descriptors
  declare, V's second 64 columns read from its first and K's k-steps past column 64 from the
  first block (head dim 128), both m64 halves of the wide kernel's 128 queries reading the
  first half's Q rows, the wgmma dQ's dP taking K for V and its dK/dV's dK taking dO for Q.
"""

import pytest
import test_emulation_16bit as E
import torch
from host_cuda import build

from cudnn_attn.fallback_kernels import _loader
from cudnn_attn.fallback_kernels import fused as F

SWAP = ('"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])', '"r"(a[0]), "r"(a[2]), "r"(a[1]), "r"(a[3])')
LANES = (("const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;\n"
          "    if constexpr (sizeof(T) == 2 && NA_PIPELINED) {"),
         ("const int lane = threadIdx.x & 31, g = lane & 7, t = lane >> 3;\n"
          "    if constexpr (sizeof(T) == 2 && NA_PIPELINED) {"))
BF16_ROUND = ('asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));',
              "h.bits = (na_u16)(__float_as_uint(f) >> 16);  // truncation")

# The pipelined build: tile i read before its cp.async group is waited for; an ldmatrix row
# address from the wrong lane half.
NO_WAIT = ("na_cp_async_wait_n<STAGES - 2>();  // this thread's",
           "/* no wait */  // this thread's")
LDSM_ROWS = ("na_ldsm_x4(a, A + (lane % 16) * LD + k0 + (lane / 16) * 8);",
             "na_ldsm_x4(a, A + (lane % 8) * LD + k0 + (lane / 8 % 2) * 8);")

# The forward's one barrier per key tile: without it a stage is refilled while other warps may
# still read it (shows with copies landing at once).
RING_BARRIER = ("__syncthreads();  // everyone's; and everyone is done with tile it - 1",
                "/* no barrier */  // everyone's; and everyone is done with tile it - 1")
# Every key tile taken as seen whole by every query (forward and dQ): the mask is skipped where
# it matters.
ALL_WHOLE = ("if (!whole)\n            na_forward_logits<NT, true>",
             "if (false)\n            na_forward_logits<NT, true>")

# The bit masks of masked tiles (forward, dQ, wide forward): a run of seen slots not repeated
# across its axis' periods; every thread's columns read from the first thread's bits.
PERIOD_NOT_REPEATED = ("for (int w = period; w < 64; w <<= 1) ones |= ones << w;",
                       "/* one period only */")
COLUMNS_UNSHIFTED = ("period_ones, first) >> (2 * t);\n#pragma unroll",
                     "period_ones, first);\n#pragma unroll")

# The wide forward and dQ (128-query boxes), run on every case (``WIDE``): the mask skipped on
# every tile (the forward's call names its mask form, BITS); the one barrier per key step removed.
WIDE_ALL_WHOLE = ("if (!whole)\n                na_forward_logits<NT, true, BITS>(s[mt]",
                  "if (false)\n                na_forward_logits<NT, true, BITS>(s[mt]")
WIDE_RING_BARRIER = ("__syncthreads();  // everyone's; and everyone is done with step it - 1",
                     "/* no barrier */  // everyone's; and everyone is done with step it - 1")
WIDE_DQ_ALL_WHOLE = ("if (!whole)\n                na_forward_logits<NT, true, false>(s[mt]",
                     "if (false)\n                na_forward_logits<NT, true, false>(s[mt]")
WIDE_DQ_RING_BARRIER = ("__syncthreads();  // step it (and Q, dO) landed for all;",
                        "/* no barrier */  // step it (and Q, dO) landed for all;")

DKDV_BARRIER = ("__syncthreads();  // step `step` landed for all; step - 1 is done everywhere",
                "/* no barrier */  // step `step` landed for all; step - 1 is done everywhere")
# dK/dV taking every query tile as seeing the whole key box.
DKDV_ALL_WHOLE = ("if (!whole) {\n                        const NaQuerySlot& qs",
                  "if (false) {\n                        const NaQuerySlot& qs")

# The ring's copy of a whole box (every operand aligned and as wide as the compiled head dim, no
# slot clipped: no test per piece) reading the neighbouring token's row for K.
WHOLE_BOX_COPY = ("src0 + c + tok * st0);", "src0 + c + (tok ^ 1) * st0);")
# name -> ((old, new), replacements expected, dtype, pipelined build)
MUTATIONS = {
    "swapped-fragment-register": (SWAP, 2, torch.float16, False),
    "wrong-lane-mapping": (LANES, 2, torch.bfloat16, False),
    "wrong-bf16-rounding": (BF16_ROUND, 1, torch.bfloat16, False),
    "pipelined-missing-cp-async-wait": (NO_WAIT, 3, torch.float16, True),
    "pipelined-wrong-ldmatrix-rows": (LDSM_ROWS, 1, torch.bfloat16, True),
    "pipelined-dkdv-missing-barrier": (DKDV_BARRIER, 1, torch.float16, True),
    "pipelined-forward-missing-ring-barrier": (RING_BARRIER, 1, torch.bfloat16, True),
    "pipelined-query-major-mask-skipped": (ALL_WHOLE, 2, torch.float16, True),
    "pipelined-dkdv-mask-skipped": (DKDV_ALL_WHOLE, 1, torch.bfloat16, True),
    "pipelined-mask-period-not-repeated": (PERIOD_NOT_REPEATED, 1, torch.float16, True),
    "pipelined-mask-columns-unshifted": (COLUMNS_UNSHIFTED, 1, torch.bfloat16, True),
    "wide-forward-mask-skipped": (WIDE_ALL_WHOLE, 1, torch.float16, True),
    "wide-forward-missing-ring-barrier": (WIDE_RING_BARRIER, 1, torch.bfloat16, True),
    "wide-dq-mask-skipped": (WIDE_DQ_ALL_WHOLE, 1, torch.bfloat16, True),
    "wide-dq-missing-ring-barrier": (WIDE_DQ_RING_BARRIER, 1, torch.float16, True),
    # dK/dV's text serves the 64- and 128-key instances: here the wide one (128-key boxes).
    "wide-dkdv-mask-skipped": (DKDV_ALL_WHOLE, 1, torch.float16, True),
    "wide-dkdv-missing-barrier": (DKDV_BARRIER, 1, torch.bfloat16, True),
    "pipelined-whole-box-copy-wrong-row": (WHOLE_BOX_COPY, 1, torch.float16, True),
}
# Copies land at once for these (a buffer overwritten too early only shows then).
EAGER = {"pipelined-dkdv-missing-barrier", "pipelined-forward-missing-ring-barrier",
         "wide-forward-missing-ring-barrier", "wide-dq-missing-ring-barrier",
         "wide-dkdv-missing-barrier"}
# Every kernel takes the wide kernels' boxes for these, whatever the tile model would say.
WIDE = {"wide-forward-mask-skipped", "wide-forward-missing-ring-barrier", "wide-dq-mask-skipped",
        "wide-dq-missing-ring-barrier", "wide-dkdv-mask-skipped", "wide-dkdv-missing-barrier"}
# Mutations of one backward kernel: caught in its outputs alone.
CAUGHT_IN = {"wide-dq-mask-skipped": {"dq"}, "wide-dq-missing-ring-barrier": {"dq"},
             "wide-dkdv-mask-skipped": {"dk", "dv"}, "wide-dkdv-missing-barrier": {"dk", "dv"}}
CASES = ("1d-rpb", "3d-causal", "2d-gqa-dv-causal", "1d-long-window")
# Mutations of a path only some cases reach -> those cases (the whole-box copy: head dim 32
# filled by both operands, aligned rows, key tiles inside the key range).
REACHED_BY = {"pipelined-whole-box-copy-wrong-row": ("2d-many-tiles-causal",)}


DECIDING = ("1d-rpb", "2d-gqa-dv-causal")  # a mutation of every case must fail one of these


def _failures(mutation: str, dtype) -> dict:
    """case -> the failing outputs of the mutant in it. A mutation of one kernel's outputs
    (``CAUGHT_IN``) runs every case (each must fail in those outputs alone); another stops at the
    first deciding case it fails, the others being what the report shows when none does."""
    names = REACHED_BY.get(mutation)
    if names is None:
        names = DECIDING + tuple(c for c in CASES if c not in DECIDING)
    failing = {}
    for name in names:
        failing[name] = E.neighborhood_failures(name, dtype)
        if failing[name] and mutation not in CAUGHT_IN and (
                mutation in REACHED_BY or name in DECIDING):
            break  # caught where it must be: the remaining cases cannot change the verdict
    return failing


def mutated_source(old: str, new: str, pipelined: bool = False) -> tuple[str, int]:
    text = _loader.source_text(F.SOURCE, F.PIPELINED_DEFINES if pipelined else F.DEFINES)
    return text.replace(old, new), text.count(old)


def mutant(mutation: str) -> tuple[list[str], str]:
    """The expressions and the mutated source text of ``mutation``'s host library."""
    if mutation in HOPPER_MUTATIONS:
        old, new, _, kernel, _ = HOPPER_MUTATIONS[mutation]
        backward = kernel in HOPPER_CAUGHT_IN  # then the whole backward on wgmma twins
        whole = E.HOPPER_BACKWARDS["backward-wide" if "wide" in kernel else "backward"]
        kernels = (sorted(whole - {"na_fused_backward_delta"}) if backward else [kernel])
        exprs = [F.expression(k, torch.bfloat16, hd) for k in kernels for hd in F.HOPPER_HEAD_DIMS]
        exprs += [F.expression("na_fused_backward_delta", torch.bfloat16, hd) for hd in F.HEAD_DIMS
                  if backward]
        return exprs, _loader.source_text(F.SOURCE, F.HOPPER_DEFINES).replace(old, new)
    (old, new), _, dtype, pipelined = MUTATIONS[mutation]
    return (E.fused_expressions(dtypes=(dtype,), head_dims=(32,),
                                kernels=E.PIPELINED_KERNELS if pipelined else F.KERNELS),
            mutated_source(old, new, pipelined)[0])


@pytest.fixture(scope="module")
def mutants(request, tmp_path_factory):
    """mutation -> its library's future: the mutations this session runs, compiled ahead on
    ``default_jobs()`` g++ processes (one library each, ~6 s) in the order the tests take them."""
    from cudnn_attn.fallback_kernels import default_jobs

    calls = [getattr(item, "callspec", None) for item in request.session.items
             if item.module is request.module]
    selected = [call.params["mutation"] for call in calls if call and "mutation" in call.params]
    yield from build.builds_ahead(request, tmp_path_factory, F,
                                  {m: mutant(m) for m in dict.fromkeys(selected)}, default_jobs())


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_fails_the_oracle_comparison(mutants, monkeypatch, mutation):
    (old, new), expected, dtype, pipelined = MUTATIONS[mutation]
    count = mutated_source(old, new, pipelined)[1]
    assert count == expected, f"the kernel text changed: {count} sites for {mutation}"
    lib = build.library(mutants[mutation])
    calls = E.route_fused(monkeypatch, lib, pipelined)
    if mutation in EAGER:
        monkeypatch.setenv("NA_EMU_CP_ASYNC_EAGER", "1")
    if mutation in WIDE:
        from cudnn_attn.fallback_kernels import tile_model

        monkeypatch.setattr(tile_model, "forward_tiles", tile_model.wide_tiles)
        monkeypatch.setattr(tile_model, "dkdv_tiles", tile_model.wide_key_tiles)
    failing = _failures(mutation, dtype)
    assert mutation not in WIDE or set(F.WIDE_KERNELS) <= set(calls)  # head dim 32: every one
    report = {name: len(f) for name, f in failing.items()}
    print(f"{mutation}: {count} site(s) replaced; failing outputs per case {report}: "
          + "; ".join(f[0] for f in failing.values() if f))
    # Not every case reaches every site (head dims of 12/20 halves stage without cp.async; one
    # query head per kv head gives dK/dV few steps), so: caught by at least one case.
    assert any(failing.values()), f"{mutation} went unnoticed in {report}"
    if mutation not in REACHED_BY:
        assert any(failing[name] for name in DECIDING)
    if mutation in CAUGHT_IN:
        names = {f.split(":")[0] for fs in failing.values() for f in fs}
        assert names and names <= CAUGHT_IN[mutation], names


# The Hopper forwards: mutation -> (old, new, sites, the wgmma kernel run, cases that reach it).
_WIDE_WG, _NARROW_WG = "na_fused_forward_wide_wgmma", "na_fused_forward_wgmma"
_HD128 = ("1d-hd128-whole-tiles",)  # 300 queries: both m64 halves, V's two column blocks
HOPPER_MUTATIONS = {
    "hopper-copy-unswizzled": ("((((c >> 3) & 7) ^ (r & 7)) << 3)", "(((c >> 3) & 7) << 3)", 1,
                               _WIDE_WG, ("2d-softcap-hd64-rpb", *_HD128)),
    "hopper-v-column-blocks-overlaid": ("na_wg_desc(V, KEYS * 128, 1024)", "na_wg_desc(V, 0, 1024)",
                                        1, _NARROW_WG, _HD128),
    "hopper-q-rows-of-the-first-half": ("mt * 64 * 64 + (kk % 4) * 16", "(kk % 4) * 16", 1,
                                        _WIDE_WG, _HD128),
    "hopper-k-columns-of-the-first-block": ("na_wg_at(kd, (kk / 4) * NT * 8 * 64 + (kk % 4) * 16)",
                                            "na_wg_at(kd, (kk % 4) * 16)", 1, _NARROW_WG, _HD128),
    # dQ's dP = dO V^T taking K for V; dK += dS^T Q taking dO for Q.
    "hopper-dq-dp-from-keys": ("(dp1, sDO, ring.values(it))", "(dp1, sDO, ring.keys(it))", 1,
                               "na_fused_backward_dq_wgmma", ("2d-softcap-hd64-rpb",)),
    "hopper-wide-dq-dp-from-keys": ("(dp, dof, sDO, sDOw, ring.values(it))",
                                    "(dp, dof, sDO, sDOw, ring.keys(it))", 1,
                                    "na_fused_backward_dq_wide_wgmma", ("1d-hd64-whole-tiles",)),
    "hopper-dk-from-do": ("(dk_acc, dp, sQ);\n        } else\n#endif",
                          "(dk_acc, dp, sDO);\n        } else\n#endif", 1,
                          "na_fused_backward_dkdv_wgmma", ("2d-softcap-hd64-rpb",)),
}
# A backward mutation shows in its kernel's outputs alone.
HOPPER_CAUGHT_IN = {"na_fused_backward_dq_wgmma": {"dq"}, "na_fused_backward_dkdv_wgmma": {"dk"},
                    "na_fused_backward_dq_wide_wgmma": {"dq"}}


@pytest.mark.parametrize("mutation", list(HOPPER_MUTATIONS))
def test_hopper_mutation_fails_the_oracle_comparison(mutants, monkeypatch, mutation):
    from cudnn_attn.fallback_kernels import tile_model

    old, new, expected, kernel, cases = HOPPER_MUTATIONS[mutation]
    text = _loader.source_text(F.SOURCE, F.HOPPER_DEFINES)
    assert text.count(old) == expected, f"the kernel text changed for {mutation}"
    backward = kernel in HOPPER_CAUGHT_IN
    lib = build.library(mutants[mutation])
    monkeypatch.setenv(F.HOPPER_ENV, "1")
    calls = E.route_fused(monkeypatch, lib, pipelined=True)
    monkeypatch.setattr(tile_model, "forward_tiles", getattr(tile_model, E.HOPPER_BOXES[kernel]))
    monkeypatch.setattr(tile_model, "dkdv_tiles", tile_model.choose_tiles)
    failing = {name: E.neighborhood_failures(name, torch.bfloat16, backward=backward)
               for name in cases}
    assert kernel in calls
    assert all(failing.values()), f"{mutation} went unnoticed: {failing}"
    if backward:
        caught = {f.split(":")[0] for fs in failing.values() for f in fs}
        assert caught == HOPPER_CAUGHT_IN[kernel], failing
