"""``cudnn_attn.natten.context`` is ``cudnn_attn.compat.natten.context`` (the same module object),
as ``natten.context``."""
import sys

from ..compat.natten import context as _target

sys.modules[__name__] = _target
