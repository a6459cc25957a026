"""Free a ``pygraph`` whose node carries a ``score_mod`` callback once the graph is dropped.

The cuDNN frontend (1.32) lowers a ``pygraph`` to its C++ graph and stores each Python callback
(``score_mod``, ``score_mod_bprop``) wrapped in a closure over its own ``lower_tensor``, which
closes over that C++ graph. C++ graph -> callback -> ``lower_tensor`` -> C++ graph is a cycle the
collector cannot see (its first edge lives in C++), so without help such a graph is never freed:
its memory stays for the life of the process and nanobind reports it as leaked at exit (issue 36).

``freed_with(graph, callback)`` wraps a callback before it reaches the frontend. The wrapper
notes the lowering closure that the frontend hands to the callback (on its graph shim, as
``_lower``); when ``graph``, the Python object the package holds, is collected, the noted
closures drop what they captured, which breaks the cycle and lets the C++ graph go. The C++
graph is no longer reachable from Python by then, so nothing can lower through it again.
A frontend that passes its C++ graph to callbacks directly makes no such cycle: nothing is noted.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

__all__ = ["freed_with"]


def freed_with(graph: Any, callback: Optional[Callable]) -> Optional[Callable]:
    """``callback`` (``fn(graph, tensor) -> tensor``), wrapped so that the frontend's lowering
    closures it is called with are released when ``graph`` is collected. ``None`` stays ``None``;
    a graph that takes no weak reference (the C++ graph itself) gets ``callback`` unchanged."""
    if callback is None:
        return None
    try:
        noted: list = []
        weakref.finalize(graph, _release, noted)
    except TypeError:  # no weak references: the frontend's C++ graph, which wraps nothing
        return callback

    def noting(g, tensor):
        lower = getattr(g, "_lower", None)
        if callable(lower) and lower not in noted:
            noted.append(lower)
        return callback(g, tensor)

    return noting


def _release(closures: list) -> None:
    for fn in closures:
        for cell in getattr(fn, "__closure__", None) or ():
            cell.cell_contents = None
    closures.clear()
