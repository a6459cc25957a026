"""``import cudnn_attn.natten as natten``: NATTEN's public namespace on cudnn_attn's engines.

NATTEN 0.21's ``na1d/na2d/na3d``, ``attention``, ``merge_attentions``, the modules
``NeighborhoodAttention1D/2D/3D``, the context flags (``use_deterministic_algorithms``, ...), and
NATTEN 0.17's unfused ``na{1,2,3}d_qk/av`` and ``use_fused_na``; ``natten.functional`` and
``natten.context`` as submodules; NATTEN 0.21.7's probes (``__version__``, ``HAS_LIBNATTEN``,
``get_configs_for_*`` / ``get_bwd_configs_for_*``: ``cudnn_attn.compat.natten.probes``). Same signatures, defaults and errors as NATTEN; our extras are
keyword-only (``rpb=``, ``use_fused=``). ``cudnn_attn.neighborhood`` is the same namespace.
"""
from ..compat.natten import context, functional  # noqa: F401  (submodules, as NATTEN's)
from ..compat.natten.context import *  # noqa: F401,F403
from ..compat.natten.context import __all__ as _context_all
from ..compat.natten.functional import *  # noqa: F401,F403
from ..compat.natten.functional import __all__ as _functional_all
from ..compat.natten.modules import *  # noqa: F401,F403
from ..compat.natten.modules import __all__ as _modules_all
from ..compat.natten.probes import *  # noqa: F401,F403
from ..compat.natten.probes import __all__ as _probes_all
from ..compat.natten.probes import __version__  # noqa: F401  (explicit: a dunder name)

__all__ = sorted((set(_functional_all) | set(_modules_all) | set(_context_all) | set(_probes_all))
                 - {"deterministic_scope", "reset"})
