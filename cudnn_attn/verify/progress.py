"""The selftest's progress on stderr: a bar on a terminal, one flushed line per verdict otherwise.

A log file (a GPU run's step log, CI) gets the lines, so a run cut short still shows how far it
came and what failed on the way; a terminal gets a tqdm bar (or a one-line counter).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .checks import Outcome

__all__ = ["progress_reporter", "verdict_line"]


def verdict_line(outcome: Outcome, done: int, total: int) -> str:
    """``selftest torch 3/58 float32 causal-top-left: pass (fwd 0.91x, bwd 1.02x) 0.02 s``."""
    ratios = ", ".join(f"{name} {value:.2f}x" for name, value in
                       (("fwd", outcome.forward_ratio), ("bwd", outcome.backward_ratio))
                       if value is not None)
    why = f": {' | '.join(outcome.detail)[:300]}" if outcome.status != "pass" and outcome.detail \
        else ""
    return (f"selftest {outcome.backend} {done}/{total} {outcome.dtype} {outcome.case.name}: "
            f"{outcome.status}{f' ({ratios})' if ratios else ''} {outcome.seconds:.2f} s{why}")


def _bar(total: int) -> Callable[[Outcome], None]:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        done = [0]

        def count(outcome: Outcome) -> None:
            done[0] += 1
            label = f"{outcome.backend} {outcome.dtype} {outcome.case.name}"
            end = "\n" if done[0] == total else ""
            sys.stderr.write(f"\rselftest {done[0]}/{total} {label[:50]:<50}{end}")
            sys.stderr.flush()
        return count

    bar = tqdm(total=total, unit="case", leave=False)

    def advance(outcome: Outcome) -> None:
        bar.set_description_str(f"{outcome.backend} {outcome.dtype} {outcome.case.name}"[:40])
        bar.update()
        if bar.n == total:
            bar.close()
    return advance


def progress_reporter(total: int, enabled: bool, lines: bool | None = None,
                      first: int = 0) -> Callable[[Outcome], None]:
    """A callable to give each judged :class:`Outcome`: nothing when not ``enabled``, else a bar
    when stderr is a terminal and ``lines`` is not True, else one line per verdict. ``first``:
    how many of ``total`` were judged before (a restarted engine process counts on)."""
    if not enabled:
        return lambda outcome: None
    if lines is None:
        lines = not sys.stderr.isatty()
    if not lines:
        return _bar(total)
    done = [first]

    def line(outcome: Outcome) -> None:
        done[0] += 1
        sys.stderr.write(verdict_line(outcome, done[0], total) + "\n")
        sys.stderr.flush()
    return line
