"""``cudnn_attn.ops`` is ``cudnn_attn.compat.natten.ops`` (the same module object)."""
import sys
from .compat.natten.ops import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]
