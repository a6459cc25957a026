"""FlashAttention's APIs: ``mha`` (the C++ ``mha_*`` entry points of PyTorch's ``flash_api.h``) and
``interface`` (FlashAttention 2.8's Python API, ``flash_attn_func`` ... ``flash_attn_with_kvcache``)."""
