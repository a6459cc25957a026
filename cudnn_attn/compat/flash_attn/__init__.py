"""FlashAttention's APIs: ``mha`` (the C++ ``mha_*`` entry points of PyTorch's ``flash_api.h``)."""
