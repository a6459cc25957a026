"""The wide fused kernels (32 rows per warp), as a kernel module for ``compile_all``.

The pipelined build's text (``fused_attention.cu`` with ``NA_PIPELINED=1``), its wide instances
only (``fused.WIDE_KERNELS``: the forward and dQ over 128-query boxes, dK/dV over 128-key boxes),
compiled for sm_90 and newer (``fused.wide``); ``fused`` launches them when the block's own box
holds ``tile_shapes.WIDE_QUERY_TILE`` queries or ``WIDE_KEY_TILE`` keys. Nothing here launches:
the definitions live in ``fused``.
"""

from __future__ import annotations

from .fused_build import PIPELINED_DEFINES as DEFINES
from .fused_build import SOURCE
from .fused_build import WIDE_MIN_ARCH as MIN_ARCH
from .fused_build import wide_variants as variants

__all__ = ["SOURCE", "DEFINES", "MIN_ARCH", "variants"]
