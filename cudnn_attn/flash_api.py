"""``cudnn_attn.flash_api`` is ``cudnn_attn.compat.flash_attn.mha`` (the same module object)."""
import sys
from typing import TYPE_CHECKING
from .compat.flash_attn.mha import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]

if TYPE_CHECKING:  # type checkers see the names of the module this one is
    from .compat.flash_attn.mha import *  # noqa: F401,F403
