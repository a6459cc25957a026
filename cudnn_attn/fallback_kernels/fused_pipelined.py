"""The sm_80+ pipelined build of the fused kernels, as a kernel module for ``compile_all``.

Same source as ``fused`` (``fused_attention.cu``) compiled with ``NA_PIPELINED=1``: every thread
keeps the geometry in registers, the other side streams through a ring of cp.async stages,
fragments load with ldmatrix. fp16/bf16 only; ``fused`` launches it on sm_80+ devices
(``fused.pipelined``). Nothing here launches: the definitions live in ``fused``.
"""

from __future__ import annotations

from .fused_build import PIPELINED_DEFINES as DEFINES
from .fused_build import PIPELINED_MIN_ARCH as MIN_ARCH
from .fused_build import SOURCE
from .fused_build import pipelined_variants as variants

__all__ = ["SOURCE", "DEFINES", "MIN_ARCH", "variants"]
