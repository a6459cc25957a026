"""The Hopper build of the fused kernels (wgmma), as a kernel module for ``compile_all``.

``na_fused_forward<T, HD, true>`` and ``na_fused_forward_wide<T, HD, true>``: the 64-query and the
128-query (wide) forwards with both products, Q K^T and P V, on ``wgmma.mma_async`` (warpgroup
MMA) instead of mma.sync. K and V stream through the cp.async ring in the 128-byte-swizzled
layout the tensor cores read through descriptors (no ldmatrix); P comes from the accumulator
registers; Q from the warps' A fragments (64-query forward: one m64 product per block) or from
swizzled shared memory (wide: two m64 halves). ``na_fused_backward_dq<T, HD, true>``: the
64-query dQ's three products (S = Q K^T with Q in A fragments, dP = dO V^T with dO swizzled in
shared memory, dQ += dS K with dS from registers and K MN-major) and
``na_fused_backward_dkdv<T, HD, 64, true>``: dK/dV's four (S^T = K Q^T and dP^T = V dO^T with
K, V, Q and dO swizzled in shared memory, dV += P^T dO and dK += dS^T Q from registers);
``na_fused_backward_dq_wide<T, HD, true>``: the wide dQ's three products over two m64 halves,
Q, dO, K and V swizzled (16-key steps at head dim 128: m64n16 products). The text is the
pipelined build's with ``NA_WGMMA=1``, compiled for ``sm_90a`` (``TARGETS``: wgmma exists on sm_90 only, so the cubins
run on H100/H200, not on Blackwell); fp16/bf16 at head dims 64 and 128.

Opt-in (``CUDNN_ATTN_NA_WGMMA=1``, ``fused_build.hopper``) until a GPU run has proven it: the
host emulation checks it against the oracle (``tests/host_cuda``: the wgmma descriptors and
swizzle as the PTX ISA describes them), but no H100/H200 has executed it yet. ``fused`` launches
the wgmma twin of each kernel the tile model chose (the wide dK/dV has none yet), once the
device has passed the layout probe (``wgmma_probe``).
Nothing here launches.
"""

from __future__ import annotations

from .fused_build import HOPPER_DEFINES as DEFINES
from .fused_build import HOPPER_TARGETS as TARGETS
from .fused_build import SOURCE, WIDE_MIN_ARCH as MIN_ARCH
from .fused_build import hopper_variants as variants

__all__ = ["SOURCE", "DEFINES", "MIN_ARCH", "TARGETS", "variants"]
