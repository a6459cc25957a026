"""CPU: the 16-bit emulation catches broken tensor-core code.

Each mutation is a string replacement in a COPY of the fused kernel's source text (exactly what
NVRTC would compile, ``_loader.source_text``), compiled for the host; the same oracle comparison
that ``test_emulation_16bit.py`` passes must then fail. The unmutated text passes it (that test).

* swapped fragment registers: A registers 1 and 2 (rows g+8 / columns +8) exchanged at the mma;
* wrong lane mapping: the A/B fragment loads of ``na_mma_abt`` with group and thread-in-group
  taken from the wrong lane bits (g = lane & 7, t = lane >> 3: same ranges, no stray memory);
* wrong bf16 rounding: the f32 -> bf16 store conversion truncating instead of rounding to
  nearest even (its error is below one ulp; the rounding-bias rule catches it).
"""

import pytest
import test_emulation_16bit as E
import torch
from host_cuda import build

from cudnn_attn.fallback_kernels import _loader
from cudnn_attn.fallback_kernels import fused as F

SWAP = ('"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])', '"r"(a[0]), "r"(a[2]), "r"(a[1]), "r"(a[3])')
LANES = ("const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;\n"
         "    if constexpr (sizeof(T) == 2) {\n        for (int k0 = 0;",
         "const int lane = threadIdx.x & 31, g = lane & 7, t = lane >> 3;\n"
         "    if constexpr (sizeof(T) == 2) {\n        for (int k0 = 0;")
BF16_ROUND = ('asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));',
              "h.bits = (na_u16)(__float_as_uint(f) >> 16);  // truncation")

# name -> ((old, new), replacements expected, dtype)
MUTATIONS = {
    "swapped-fragment-register": (SWAP, 2, torch.float16),
    "wrong-lane-mapping": (LANES, 1, torch.bfloat16),
    "wrong-bf16-rounding": (BF16_ROUND, 1, torch.bfloat16),
}
CASES = ("1d-rpb", "3d-causal")


def mutated_source(old: str, new: str) -> tuple[str, int]:
    text = _loader.source_text(F.SOURCE, F.DEFINES)
    return text.replace(old, new), text.count(old)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_fails_the_oracle_comparison(request, tmp_path_factory, monkeypatch, mutation):
    (old, new), expected, dtype = MUTATIONS[mutation]
    source, count = mutated_source(old, new)
    assert count == expected, f"the kernel text changed: {count} sites for {mutation}"
    lib = build.host_library(request, tmp_path_factory, F,
                             E.fused_expressions(dtypes=(dtype,), head_dims=(32,)), source=source)
    E.route_fused(monkeypatch, lib)
    failing = {name: E.neighborhood_failures(name, dtype) for name in CASES}
    report = {name: len(f) for name, f in failing.items()}
    print(f"{mutation}: {count} site(s) replaced; failing outputs per case {report}: "
          + "; ".join(f[0] for f in failing.values() if f))
    assert all(failing.values()), f"{mutation} went unnoticed in {report}"
