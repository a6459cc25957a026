"""Optional plotting for the examples: matplotlib when installed (``pip install
'cudnn-attn[plot]'``), else a one-line message and no figure. Imported by the examples only."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (after saying so)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'cudnn-attn[plot]'): skipping the plot")
        return None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}")


def output_file(text: str) -> str:
    """argparse type: where a figure goes; '' for none. Its folder must exist: a typo in a
    path is refused before training, not after."""
    import argparse
    from pathlib import Path

    if text and not Path(text).expanduser().resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory {str(Path(text).parent)!r}")
    return text


def existing_file(text: str) -> Any:
    """argparse type: a file that exists, as a ``Path``."""
    import argparse
    from pathlib import Path

    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


def cpu_threads(requested: int | None, device: Any) -> None:
    """Use ``requested`` CPU threads (default 1): the examples' tensors are tiny, and on a busy
    machine more threads mostly wait on each other (measured: 30x slower on a loaded 2-core box)."""
    import torch

    if device.type == "cpu":
        torch.set_num_threads(requested or 1)
