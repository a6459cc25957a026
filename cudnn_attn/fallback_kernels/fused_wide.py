"""The wide fused forward and dQ (128-query boxes, 32 rows per warp), as a kernel module for
``compile_all``.

The pipelined build's text (``fused_attention.cu`` with ``NA_PIPELINED=1``), its
``na_fused_forward_wide`` and ``na_fused_backward_dq_wide`` instances only, compiled for sm_90 and
newer (``fused.wide``); ``fused`` launches them when the query box holds
``tile_shapes.WIDE_QUERY_TILE`` slots. Nothing here launches: the definitions live in ``fused``.
"""

from __future__ import annotations

from .fused import PIPELINED_DEFINES as DEFINES
from .fused import SOURCE
from .fused import WIDE_MIN_ARCH as MIN_ARCH
from .fused import wide_variants as variants

__all__ = ["SOURCE", "DEFINES", "MIN_ARCH", "variants"]
