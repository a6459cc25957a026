"""What every subcommand shares on its way out: JSON on stdout, and a reader that went away."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout (values JSON lacks, such as paths, as text)."""
    print(json.dumps(data, indent=2, default=str))


def silence_stdout() -> None:
    """Point stdout at /dev/null after a ``BrokenPipeError``: the reader (``| head -1``) left on
    purpose, so neither the write in progress nor the interpreter's final flush may complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a descriptor (captured in a test)
        pass
