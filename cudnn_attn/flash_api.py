"""``cudnn_attn.flash_api`` is ``cudnn_attn.compat.flash_attn.mha`` (the same module object)."""
import sys
from .compat.flash_attn.mha import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]
