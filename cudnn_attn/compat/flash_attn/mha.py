"""FlashAttention's C++ entry points (PyTorch's ``flash_api.h``) on every engine.

``mha_fwd``, ``mha_varlen_fwd``, ``mha_bwd`` and ``mha_varlen_bwd`` take the positional arguments
of ``pytorch_flash::mha_*`` (with ``softcap`` after ``window_size_right``, as in current
FlashAttention 2) and return the same tuples. Each call becomes one ``AttnProblem`` in the
``"bshd"`` layout (varlen calls: a padded batch with a ``Padding`` mask) and runs on the engine the
dispatcher selects: cuDNN where it can express the call, otherwise the torch engine.

FlashAttention semantics (``S_q``/``S_k`` the lengths of one sequence):

* causal is aligned bottom-right: query ``i`` sees keys ``j <= i + S_k - S_q``. Windows are
  inclusive, ``i + S_k - S_q - left <= j <= i + S_k - S_q + right``; a negative size is
  unbounded. As FlashAttention does, a window ``>= S_k`` (``max_seqlen_k`` for varlen) becomes
  unbounded and ``is_causal`` sets ``window_size_right = 0``.
* ``alibi_slopes_`` (``[H]`` or ``[B, H]``, float32 or float64) adds
  ``-slope * |i + S_k - S_q - j|``. ``softcap > 0`` maps scores to ``softcap * tanh(s / softcap)``
  before ALiBi. GQA: ``H_q % H_k == 0``, query head ``h`` reads kv head ``h // (H_q // H_k)``.
* ``p_dropout`` is the probability of dropping an attention weight; kept weights scale by
  ``1 / (1 - p_dropout)``. Softcap with dropout is allowed here (FlashAttention refuses it).

Conventions of this implementation (where FlashAttention leaves room or differs):

* ``q_padded``, ``k_padded``, ``v_padded`` are the inputs themselves: no engine needs the head
  dim padded to a multiple of 8, so nothing is padded (any head dim works; ``D_v`` may differ
  from ``D_qk``).
* ``softmax_lse`` is float32 (float64 for float64 inputs), ``[B, H, S_q]``; varlen: ``[H,
  total_q]``. A row that sees no key gets ``out = 0`` and ``lse = -inf`` (FlashAttention writes
  ``+inf``); the backward accepts either.
* ``philox_seed`` / ``philox_offset`` are 0-d int64 CPU tensors: the call's dropout stream
  (``DropoutState``), drawn from ``gen_`` (or the default CPU generator). Every engine derives its
  keep masks from these two numbers alone, so ``mha_bwd`` regenerates exactly the forward's keep
  mask from them (pass them back unchanged). Without dropout both are 0.
* ``return_softmax`` works with or without dropout (FlashAttention needs dropout) and returns
  ``p`` in FlashAttention's encoding: ``[B, H, round128(S_q), round128(S_k)]`` in q's dtype (varlen:
  ``[B, H, round128(max_seqlen_q), round128(max_seqlen_k)]``), zero past each sequence;
  ``|p| = exp(s - m)`` with ``m`` the running row maximum over the key blocks from this one to the
  last (``flash_attn_interface._get_block_size_n`` wide), so ``|p| * exp(m - lse)`` are the
  *pre-dropout* weights; entries the dropout mask dropped are negated (kept ones are ``>= 0``).
  See ``cudnn_attn.compat.flash_attn._probs``. The weights come from engine calls whose values
  are identity columns (``compat.flash_attn._core._weights``), about ``S_k`` value columns more:
  a testing aid, as in FlashAttention. Without it ``p`` is an empty tensor.
* ``softmax_d`` (the backward's fourth result) is ``rowsum(dout * out)``, ``[B, H, S_q]``
  (varlen ``[H, total_q]``), in the lse dtype.
* Output buffers ``out_``, ``dq_``, ``dk_``, ``dv_`` are written and returned; a buffer that
  overlaps itself (an expanded view) is refused with a ``ValueError``.
* Bad arguments raise ``ValueError``/``TypeError`` that are also ``RuntimeError`` (what
  FlashAttention's ``TORCH_CHECK`` raises). Window sizes may be 0-d integer tensors.
* ``softmax_scale`` may be ``None`` for FlashAttention's default ``head_size ** -0.5``.
* ``deterministic`` asks for a deterministic backward (as does
  ``torch.use_deterministic_algorithms(True)``). With dropout the backward must run on the engine
  that made the mask: if that engine has no deterministic backward for the call,
  ``NotSupportedError`` says so.
* ``zero_tensors`` (varlen) is accepted; every element of the results is written anyway.
* Paged KV (``block_table_``): any page size; pages are gathered into a padded batch, so every
  engine runs it. ``cu_seqlens_k`` gives the key lengths (``seqused_k`` overrides them).
"""

from .dense import mha_bwd, mha_fwd
from .varlen import mha_varlen_bwd, mha_varlen_fwd

__all__ = ["mha_fwd", "mha_varlen_fwd", "mha_bwd", "mha_varlen_bwd"]
