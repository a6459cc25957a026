"""``cudnn_attn.neighborhood``: another name for ``cudnn_attn.natten``, the same module object
(NATTEN's public namespace: ``na1d/2d/3d``, ``attention``, ``merge_attentions``, ``na*d_qk/av``,
the modules, the context flags)."""
import sys

from . import natten

sys.modules[__name__] = natten  # the import system hands out (and binds) this module instead
