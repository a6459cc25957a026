"""The cuDNN backend. Until the SDPA graph builders land it only reports why it cannot run."""

from __future__ import annotations

from .._probe import cuda_missing, module_missing
from ..problem import AttnProblem


class CudnnBackend:
    name = "cudnn"

    def availability(self) -> list[str]:
        reasons = module_missing("cudnn", "cu12") + cuda_missing()
        reasons.append("cuDNN SDPA graphs are not built yet in this version")
        return reasons

    def supports(self, problem: AttnProblem) -> list[str]:
        return self.availability()

    def plan(self, problem: AttnProblem):
        raise NotImplementedError("the cuDNN backend has no graph builders yet")
