"""FlashAttention 2.8's Python API (``flash_attn.flash_attn_interface``) on every engine.

Replace ``from flash_attn import flash_attn_func`` (or ``from flash_attn.flash_attn_interface
import ...``) with ``from cudnn_attn.flash_attn_interface import flash_attn_func``: the same names,
argument order, defaults and return values as flash-attn 2.8.3. The ``*_func`` functions are
differentiable (autograd over ``mha_fwd``/``mha_bwd`` and their varlen forms);
``flash_attn_with_kvcache`` is inference-only, as in FlashAttention.

Where this differs from FlashAttention (it accepts more, never less):

* any float dtype (float64/float32 too), any head size, ``D_v != D``, any page size, softcap with
  dropout, and CPU tensors: the call runs on the engine the dispatcher selects;
* a query row that sees no key gets ``out = 0`` and ``softmax_lse = -inf`` (FlashAttention
  writes ``+inf``);
* ``num_splits`` is accepted and ignored (the result never depends on it);
* bad arguments raise ``ValueError``/``TypeError`` that are also ``RuntimeError`` (what
  FlashAttention's ``TORCH_CHECK`` raises), so either ``except`` catches them.

``_flash_attn_forward``, ``_flash_attn_backward``, ``_flash_attn_varlen_forward`` and
``_flash_attn_varlen_backward`` are FlashAttention 2.8.3's private functions with its exact
signatures (see ``cudnn_attn.compat.flash_attn.private``), for libraries built on them
(ring-flash-attn, yunchang); ``cudnn_attn.integrations.flash_attn.register()`` points their
``import flash_attn`` here.

``S_dmask`` (``return_attn_probs=True`` with dropout) is FlashAttention's encoding: see
``cudnn_attn.compat.flash_attn._probs``; ``_get_block_size_n`` gives its key-block width, as
FlashAttention's helper of that name does.
"""

from __future__ import annotations

from . import _probs
from ._args import FlashAttnTypeError, FlashAttnValueError
from .functions import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)
from .kvcache import flash_attn_with_kvcache
# FlashAttention's private entry points, under FlashAttention's own names (libraries import them).
from .private import (_flash_attn_backward, _flash_attn_forward, _flash_attn_varlen_backward,
                      _flash_attn_varlen_forward)

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "FlashAttnValueError",
           "FlashAttnTypeError", "_flash_attn_forward", "_flash_attn_backward",
           "_flash_attn_varlen_forward", "_flash_attn_varlen_backward"]


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width of the ``S_dmask`` encoding (FlashAttention's helper of this name;
    ``device`` is accepted and not queried)."""
    return _probs.block_size_n(head_dim, is_dropout, is_causal)
