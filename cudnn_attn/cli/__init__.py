"""Command line (also ``python -m cudnn_attn``): one module per subcommand.

``cudnn-attn info`` (``info.py``), ``demo`` (``demo.py``), ``explain --shape B,H,S,D ...``
(``explain.py``), ``cache info|warm|clear`` (``cache.py``), ``kernels`` (``kernels.py``) and
``selftest`` (``selftest.py``); this module only builds the parser and dispatches.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import cache, demo, explain, info, kernels, selftest
from .cache import progress
from .output import silence_stdout
from .specs import UsageError, parse_mask

__all__ = ["UsageError", "build_parser", "main", "parse_mask", "progress"]

SUBCOMMANDS = (info, demo, explain, cache, kernels, selftest)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def one_line(text: object) -> str:
    """``text`` with its lines joined by '; ' (multi-line messages would read as a dump)."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def build_parser() -> argparse.ArgumentParser:
    """The ``cudnn-attn`` argument parser."""
    from cudnn_attn.core import env

    parser = OneLineParser(
        prog="cudnn-attn",
        description="Attention on cuDNN graphs, CuPy kernels or PyTorch, chosen per call.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {env.package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit code.

    Bad arguments (and what they lead to: invalid problems, missing optional packages, a refused
    cache directory) print one line on stderr and return 2; a command that did none of what it
    was asked returns 1; an unexpected failure prints one line and returns 1
    (``CUDNN_ATTN_DEBUG=1`` shows its traceback). Never a traceback otherwise; a reader that
    closes the pipe early (``| head``) ends the command quietly with status 0.
    """
    try:
        code = run(argv)
        sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at exit
        return code
    except BrokenPipeError:  # `cudnn-attn explain ... | head -1`: the reader has what it wanted
        silence_stdout()
        return 0


def run(argv: Sequence[str] | None) -> int:
    """``main`` without the broken-pipe handling: parse, run, turn mistakes into one line."""
    from cudnn_attn.errors import NotSupportedError

    args = build_parser().parse_args(argv)
    prog = " ".join(filter(None, ("cudnn-attn", args.command, getattr(args, "cache_command", None))))
    try:
        return args.func(args)
    except BrokenPipeError:
        raise
    except (UsageError, ValueError, TypeError, ImportError, OSError, NotSupportedError) as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if os.environ.get("CUDNN_ATTN_DEBUG"):
            raise
        print(f"{prog}: failed: {type(exc).__name__}: {one_line(exc)[:500]} "
              f"(CUDNN_ATTN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
