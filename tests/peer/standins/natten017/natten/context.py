from cudnn_attn.natten import context as _context
from cudnn_attn.natten import use_fused_na as _use_fused_na
from cudnn_attn.natten.context import *  # noqa: F401,F403  (AutotunerContext included)


class NattenContext:
    @staticmethod
    def reset():  # NATTEN 0.17's reset: flags at their defaults, fused NA (and KV parallelism) off
        _context.NattenContext.reset()
        _use_fused_na(False)
