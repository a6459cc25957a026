"""Draw which keys each query sees for Causal, SlidingWindow and Neighborhood masks.

Needs matplotlib (``pip install 'cudnn-attn[plot]'``). The committed figure of the docs' "Masks"
page is ``docs/figures/masks.png``, drawn by the second line:

    python examples/draw_masks.py                      # writes masks.png here
    python examples/draw_masks.py --out docs/figures/masks.png

The patterns come from ``cudnn_attn.model.geometry``, the one description of every mask's visibility
that the engines and the tests share.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from cudnn_attn.model.geometry import band_mask, neighborhood_mask

HERE = Path(__file__).resolve().parent


def patterns() -> list[tuple[str, object]]:
    """``(title, [S_q, S_kv] bool)`` for each drawn mask."""
    return [
        ("Causal()  S=12", band_mask(12, 12, -1, 0)),
        ("Causal('bottom_right')  8 x 12", band_mask(8, 12, -1, 0, 4)),
        ("SlidingWindow(3, 0)  S=12", band_mask(12, 12, 3, 0)),
        ("SlidingWindow(2, 2)  S=12", band_mask(12, 12, 2, 2)),
        ("Neighborhood(12, 5)  1-D", neighborhood_mask((12,), (5,))),
        ("Neighborhood((4, 4), 3)  2-D", neighborhood_mask((4, 4), (3, 3))),
    ]


def main(argv=None) -> int:
    spec = importlib.util.spec_from_file_location("plots", HERE / "plots.py")
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="masks.png", type=plots.output_file,
                   help="PNG to write (default: masks.png in the current directory)")
    args = p.parse_args(argv)
    plt = plots.pyplot()
    if plt is None:
        return 0
    drawn = patterns()
    fig, axes = plt.subplots(2, 3, figsize=(10, 6.6))
    for ax, (title, visible) in zip(axes.flat, drawn):
        ax.imshow(visible.numpy(), cmap="Blues", vmin=0, vmax=1.4)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle("cudnn_attn masks: blue = the query (row) sees the key (column)", fontsize=10)
    plots.save(fig, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
