"""cudnn_attn: exact attention on the fastest engine your device has, behind one API.

Engines, in priority order: cuDNN-frontend SDPA graphs (``graphs/``), CuPy RawKernels for
neighborhood attention (``fallback_kernels/``), and a pure-PyTorch engine that runs anywhere
(``torch_engine/``). Importing this package never needs a GPU, CuPy or cuDNN.
"""

import importlib

from .api import Explanation, attention, explain
from .caches import clear_caches
from .compat.cudnn_frontend.attributes import (SdpaAttributes, SdpaBackwardAttributes,
                                               scaled_dot_product_flash_attention,
                                               scaled_dot_product_flash_attention_backward)
from .dispatch import NotSupportedError
from .graphs.cache import graph_cache
from .masks import Alibi, Causal, Mask, Neighborhood, Padding, RelPosBias, SlidingWindow
from .problem import AttnProblem, TensorSpec
from .varlen import attention_varlen, attention_with_kvcache

# Surfaces reachable as attributes (cudnn_attn.neighborhood, ...) load on first use.
_LAZY_MODULES = ("neighborhood", "ops", "flash_api", "flash_attention", "nn", "graphs",
                 "fallback_kernels", "compat", "cli")


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "RelPosBias",
    "clear_caches",
    "SdpaAttributes",
    "SdpaBackwardAttributes",
    "scaled_dot_product_flash_attention",
    "scaled_dot_product_flash_attention_backward",
    "AttnProblem",
    "TensorSpec",
    "__version__",
]
