"""``cudnn_attn.flash_attention`` is ``cudnn_attn.compat.teaching`` (the same module object)."""
import sys
from .compat.teaching import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]
