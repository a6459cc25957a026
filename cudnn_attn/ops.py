"""``cudnn_attn.ops`` is ``cudnn_attn.compat.natten.ops`` (the same module object)."""
import sys
from typing import TYPE_CHECKING
from .compat.natten.ops import __name__ as _target  # noqa: F401  (loads the module)

sys.modules[__name__] = sys.modules[_target]

if TYPE_CHECKING:  # type checkers see the names of the module this one is
    from .compat.natten.ops import (  # noqa: F401  (its __all__ is computed: named here)
        na1d_forward,
        na2d_forward,
        na3d_forward,
        na1d_qk_forward,
        na2d_qk_forward,
        na3d_qk_forward,
        na1d_qk_backward,
        na2d_qk_backward,
        na3d_qk_backward,
        na1d_av_forward,
        na2d_av_forward,
        na3d_av_forward,
        na1d_av_backward,
        na2d_av_backward,
        na3d_av_backward,
        valid_tile_sizes,
    )
