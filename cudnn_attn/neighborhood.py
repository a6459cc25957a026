"""``cudnn_attn.neighborhood``: NATTEN's public namespace, assembled from
``cudnn_attn.compat.natten.functional`` (na1d/2d/3d, na*d_qk/av, merge_attentions) and
``cudnn_attn.compat.natten.modules`` (NeighborhoodAttention1D/2D/3D and the fused switch)."""
from .compat.natten.functional import *  # noqa: F401,F403
from .compat.natten.functional import __all__ as _functional_all
from .compat.natten.modules import *  # noqa: F401,F403
from .compat.natten.modules import __all__ as _modules_all

__all__ = sorted(set(_functional_all) | set(_modules_all))
