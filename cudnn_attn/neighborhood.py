"""``cudnn_attn.neighborhood``: the public name of ``cudnn_attn.compat.natten.functional`` (the same module object)."""
import sys
from .compat.natten.functional import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]
