"""Compat surfaces: other libraries' APIs translated into one ``AttnProblem`` (or NATTEN's unfused
``UnfusedProblem``) and run through the run API (``cudnn_attn.core.execution``, ``unfused_ops``).

``natten`` (NATTEN's functional API, unfused ops, modules and libnatten's op layer), ``flash_attn``
(FlashAttention's C++ ``mha_*`` entry points), ``cudnn_frontend`` (the SDPA attribute builder) and
``teaching`` (the tiled flash-attention API). A surface never drives a plan, launches a kernel
or imports an engine's modules (``tests/test_architecture.py``).
"""
