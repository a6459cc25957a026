from cudnn_attn.natten.functional import *  # noqa: F401,F403
