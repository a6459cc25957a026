"""Command line (also ``python -m cudnn_attn``): one module per subcommand.

``cudnn-attn info`` (``info.py``), ``demo`` (``demo.py``), ``explain --shape B,H,S,D ...``
(``explain.py``), ``cache info|warm|clear`` (``cache.py``), ``kernels`` (``kernels.py``) and
``selftest`` (``selftest.py``); this module only builds the parser and dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import cache, demo, explain, info, kernels, selftest
from .cache import progress
from .specs import parse_mask

__all__ = ["build_parser", "main", "parse_mask", "progress"]

SUBCOMMANDS = (info, demo, explain, cache, kernels, selftest)


def build_parser() -> argparse.ArgumentParser:
    """The ``cudnn-attn`` argument parser."""
    from cudnn_attn import _env

    parser = argparse.ArgumentParser(
        prog="cudnn-attn",
        description="Attention on cuDNN graphs, CuPy kernels or PyTorch, chosen per call.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_env.package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
