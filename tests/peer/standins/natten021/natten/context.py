from cudnn_attn.natten.context import *  # noqa: F401,F403  (NattenContext included)
