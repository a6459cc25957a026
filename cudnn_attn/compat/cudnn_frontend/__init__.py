"""The cuDNN frontend's SDPA attribute builder, translated into the problem model."""

from .attributes import (SdpaAttributes, SdpaBackwardAttributes,  # noqa: F401
                         scaled_dot_product_flash_attention,
                         scaled_dot_product_flash_attention_backward)
from .fp8 import sdpa_fp8, sdpa_fp8_backward  # noqa: F401
