"""``cudnn_attn.ops`` is ``cudnn_attn.compat.natten.ops`` (the same module object)."""
import sys
from typing import TYPE_CHECKING
from .compat.natten.ops import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]

if TYPE_CHECKING:  # type checkers (and the API reference) see the names of the module this one is
    from .compat.natten.ops import *  # noqa: F401,F403
