"""Stand-in for NATTEN 0.21: cudnn_attn.natten under NATTEN's name."""
from cudnn_attn.natten import *  # noqa: F401,F403
from cudnn_attn.natten import context, functional  # noqa: F401
