"""cudnn_attn: exact attention on the fastest engine your device has, behind one API.

Engines, in priority order: cuDNN-frontend SDPA graphs (``graphs/``), CuPy RawKernels for
neighborhood attention (``fallback_kernels/``), and a pure-PyTorch engine that runs anywhere
(``reference.py``). Importing this package never needs a GPU, CuPy or cuDNN.
"""

from .api import Explanation, attention, explain
from .attributes import (SdpaAttributes, SdpaBackwardAttributes, scaled_dot_product_flash_attention,
                         scaled_dot_product_flash_attention_backward)
from .dispatch import NotSupportedError
from .graphs.cache import graph_cache
from .masks import Alibi, Causal, Mask, Neighborhood, Padding, SlidingWindow
from .problem import AttnProblem, TensorSpec
from .varlen import attention_varlen, attention_with_kvcache

# Compat surfaces and modules, reachable as cudnn_attn.flash_api etc.
from . import flash_api, flash_attention, neighborhood, nn, ops  # noqa: E402,F401  (after the core)

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "explain",
    "Explanation",
    "NotSupportedError",
    "graph_cache",
    "Mask",
    "Causal",
    "SlidingWindow",
    "Neighborhood",
    "Padding",
    "Alibi",
    "SdpaAttributes",
    "SdpaBackwardAttributes",
    "scaled_dot_product_flash_attention",
    "scaled_dot_product_flash_attention_backward",
    "AttnProblem",
    "TensorSpec",
    "__version__",
]
