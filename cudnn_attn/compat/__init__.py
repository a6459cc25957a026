"""Compat surfaces: other libraries' APIs translated into one ``AttnProblem`` and run through dispatch.

``natten`` (NATTEN's functional API, unfused ops, modules and libnatten's op layer), ``flash_attn``
(FlashAttention's C++ ``mha_*`` entry points), ``cudnn_frontend`` (the SDPA attribute builder) and
``teaching`` (the tiled flash-attention API). A surface never launches a kernel or computes
attention itself.
"""
