"""cudnn_attn: exact attention on the fastest engine your device has, behind one API.

Engines, in priority order: cuDNN-frontend SDPA graphs (``graphs/``), CuPy RawKernels for
neighborhood attention (``fallback_kernels/``), and a pure-PyTorch engine that runs anywhere
(``torch_engine/``). Importing this package never needs a GPU, CuPy or cuDNN.
"""

import importlib
import sys
from typing import TYPE_CHECKING

from .api import Explanation, attention, explain
from .core.caches import clear_caches
from .core.dispatch import NotSupportedError, exclude_backend, use_backend
from .graphs.cache import graph_cache
from .model.masks import Alibi, Causal, Mask, Neighborhood, Padding, RelPosBias, SlidingWindow
from .model.problem import AttnProblem, TensorSpec
from .varlen import attention_varlen, attention_with_kvcache

# ``cudnn_attn.model.masks`` and ``cudnn_attn.model.problem`` (DESIGN.md's names) are the problem model's
# modules themselves, not copies.
for _name in ("masks", "problem"):
    sys.modules[f"{__name__}.{_name}"] = globals()[_name] = sys.modules[f"{__name__}.model.{_name}"]

# Surfaces reachable as attributes (cudnn_attn.neighborhood, ...) load on first use.
_LAZY_MODULES = ("neighborhood", "ops", "flash_api", "flash_attention", "nn", "graphs",
                 "fallback_kernels", "compat", "cli", "distributed", "flash_attn_interface",
                 "integrations", "natten")


# The cuDNN attribute builder's names, from compat/cudnn_frontend on first use.
_BUILDER_NAMES = ("SdpaAttributes", "SdpaBackwardAttributes", "scaled_dot_product_flash_attention",
                  "scaled_dot_product_flash_attention_backward", "sdpa_fp8", "sdpa_fp8_backward")
# FP8 training (delayed scaling): cudnn_attn.fp8_training on first use.
_FP8_TRAINING_NAMES = ("attention_fp8", "FP8Attention", "DelayedScaling")


if TYPE_CHECKING:  # what the lazy names are, for type checkers and the API reference
    from .compat.cudnn_frontend import (
        SdpaAttributes,
        SdpaBackwardAttributes,
        scaled_dot_product_flash_attention,
        scaled_dot_product_flash_attention_backward,
        sdpa_fp8,
        sdpa_fp8_backward,
    )
    from .fp8_training import DelayedScaling, FP8Attention, attention_fp8
    from .verify import selftest  # (verify imports nothing of the root: no cycle)


def __getattr__(name: str) -> object:
    if name == "selftest":  # a function of the (consumer) package ``verify``
        return importlib.import_module(".verify", __name__).selftest
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _BUILDER_NAMES:
        return getattr(importlib.import_module(".compat.cudnn_frontend", __name__), name)
    if name in _FP8_TRAINING_NAMES:
        return getattr(importlib.import_module(".fp8_training", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_MODULES) | set(_BUILDER_NAMES)
                  | set(_FP8_TRAINING_NAMES) | {"selftest"})


def _installed_version() -> str:
    """The version of the installed distribution (pyproject.toml's, the one source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cudnn-attn")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


__version__: str = _installed_version()

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
    "use_backend",
    "exclude_backend",
    "selftest",
    "SdpaAttributes",
    "SdpaBackwardAttributes",
    "scaled_dot_product_flash_attention",
    "scaled_dot_product_flash_attention_backward",
    "sdpa_fp8",
    "sdpa_fp8_backward",
    "attention_fp8",
    "FP8Attention",
    "DelayedScaling",
    "AttnProblem",
    "TensorSpec",
    "__version__",
]
