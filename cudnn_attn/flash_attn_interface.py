"""``cudnn_attn.flash_attn_interface`` is ``cudnn_attn.compat.flash_attn.interface`` (the same
module object): FlashAttention 2.8's Python API, ``from cudnn_attn.flash_attn_interface import
flash_attn_func``."""
import sys
from typing import TYPE_CHECKING
from .compat.flash_attn.interface import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]

if TYPE_CHECKING:  # type checkers see the names of the module this one is
    from .compat.flash_attn.interface import *  # noqa: F401,F403
