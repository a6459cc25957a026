"""``cudnn_attn.neighborhood``: NATTEN's public namespace, the same as ``cudnn_attn.natten``
(``na1d/2d/3d``, ``attention``, ``merge_attentions``, ``na*d_qk/av``, the modules, the context
flags)."""
from .natten import *  # noqa: F401,F403
from .natten import __all__  # noqa: F401
