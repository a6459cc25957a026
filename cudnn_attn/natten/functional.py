"""``cudnn_attn.natten.functional`` is ``cudnn_attn.compat.natten.functional`` (the same module
object), as ``natten.functional``: ``from cudnn_attn.natten.functional import na2d``."""
import sys

from ..compat.natten import functional as _target

sys.modules[__name__] = _target
