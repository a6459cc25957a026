from cudnn_attn.natten import context as _context
from cudnn_attn.natten.context import *  # noqa: F401,F403


class NattenContext:
    @staticmethod
    def reset():
        _context.reset()


class AutotunerContext:  # NATTEN's kernel autotuner: nothing to tune here
    @staticmethod
    def reset():
        pass
