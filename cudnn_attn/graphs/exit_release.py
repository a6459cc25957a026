"""Release what the package's caches hold from the cuDNN frontend before the interpreter tears
the frontend's module down.

Built graphs, execution plans, handles and deviceless results sit in module-level LRUs
(``core.caches``). Left to interpreter finalization they may outlive the frontend's nanobind
module, which then reports them as leaked instances and functions on stderr (issue 36: every
process that used the cuDNN engine on an H200). ``register()`` runs on the first import of
``cudnn`` through the engine, so the hook is registered after the frontend's own (``atexit``
runs hooks last-in, first-out): ours empties the caches and collects cycles while the frontend is
intact, then the frontend destroys its default handles. A graph with a score_mod callback is
freed with the others only because ``callback_cycles`` breaks the cycle the frontend keeps it in.
"""

from __future__ import annotations

import atexit
import gc
import threading

from ..core.caches import clear_caches

__all__ = ["register", "release"]

_LOCK = threading.Lock()
_REGISTERED = False


def release() -> None:
    """Empty every cache (graphs, plans, handles, deviceless plans) and collect the cycles."""
    clear_caches()
    gc.collect()


def register() -> None:
    """Register ``release`` at interpreter exit, once per process."""
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            atexit.register(release)
            _REGISTERED = True
