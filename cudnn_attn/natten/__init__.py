"""``import cudnn_attn.natten as natten``: NATTEN's public namespace on cudnn_attn's engines.

NATTEN 0.21's ``na1d/na2d/na3d``, ``attention``, ``merge_attentions``, the modules
``NeighborhoodAttention1D/2D/3D``, the context flags (``use_deterministic_algorithms``, ...), and
NATTEN 0.17's unfused ``na{1,2,3}d_qk/av`` and ``use_fused_na``; ``natten.functional`` and
``natten.context`` as submodules. Same signatures, defaults and errors as NATTEN; our extras are
keyword-only (``rpb=``, ``use_fused=``). ``cudnn_attn.neighborhood`` is the same namespace.
"""
from ..compat.natten import context, functional  # noqa: F401  (submodules, as NATTEN's)
from ..compat.natten.context import *  # noqa: F401,F403
from ..compat.natten.context import __all__ as _context_all
from ..compat.natten.functional import *  # noqa: F401,F403
from ..compat.natten.functional import __all__ as _functional_all
from ..compat.natten.modules import *  # noqa: F401,F403
from ..compat.natten.modules import __all__ as _modules_all

__all__ = sorted((set(_functional_all) | set(_modules_all) | set(_context_all))
                 - {"deterministic_scope", "reset"})
