"""The CuPy backend. Until its kernels land it only reports why it cannot run."""

from __future__ import annotations

from .._probe import cuda_missing, module_missing
from ..problem import AttnProblem


class CupyBackend:
    name = "cupy"

    def availability(self) -> list[str]:
        reasons = module_missing("cupy", "cu12") + cuda_missing()
        reasons.append("CuPy attention kernels are not built yet in this version")
        return reasons

    def supports(self, problem: AttnProblem) -> list[str]:
        return self.availability()

    def plan(self, problem: AttnProblem):
        raise NotImplementedError("the CuPy backend has no kernels yet")
