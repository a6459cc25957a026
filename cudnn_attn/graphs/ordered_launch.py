"""Execute a built graph's backend plan through the frontend's own C++ entry, without the
frontend's per-call Python dispatch.

``pygraph.execute(buffers, workspace, handle, tensor_uids=uids)`` spends about 3 us of Python
per call (measured on the CPU with its C++ call stubbed: ``benchmarks/cudnn_host.py``, row
"frontend dispatch") re-deciding what is fixed once the graph is built: that the selected plan is
served by the cuDNN backend (not one of the frontend's Python engines), that plan's C++ index, and
the ordered binding schema of the uids. ``launcher(graph, uids)`` reads them once and returns a
callable that makes the same C++ call with the same arguments (cudnn-frontend 1.32:
``backend_graph._execute_ordered`` and, when it asks the caller to finish the variant pack,
``pygraph._finish_ordered`` then ``_execute_ordered_pack``). Where the graph is not such a graph
(not built, a Python engine's plan, a frontend without these entries, a stand-in object) it
returns ``graph.execute`` bound to the uids instead, so every caller has one way to run a graph.
A plan selected after the launcher was made (autotuning) makes it defer to ``graph.execute``.
These entries are the frontend's internals: only the releases whose ``execute`` was read and
tested against (``VALIDATED``) get the launch; any other keeps the frontend's dispatch.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["launcher", "VALIDATED"]

Launch = Callable[[list, Any, Any], None]  # (buffers in uid order, workspace, handle)

# cudnn-frontend releases (version prefixes) whose pygraph._execute this mirrors
VALIDATED = ("1.32.",)


def launcher(graph: Any, uids: tuple) -> Launch:
    """How to run ``graph`` on one buffer per uid of ``uids``, in that order."""
    fast = _BackendLaunch.of(graph, uids)
    return fast if fast is not None else _FrontendLaunch(graph, uids)


class _FrontendLaunch:
    """``graph.execute`` with ordered buffers: the frontend's own dispatch."""

    __slots__ = ("graph", "uids")

    def __init__(self, graph, uids: tuple):
        self.graph, self.uids = graph, uids

    def __call__(self, ordered: list, workspace, handle) -> None:
        self.graph.execute(ordered, workspace, handle=handle, tensor_uids=self.uids)


class _BackendLaunch:
    """The backend branch of ``pygraph.execute`` with its per-graph decisions made once."""

    __slots__ = ("graph", "uids", "lowered", "schema", "plan_index", "cpp_index", "to_backend")

    @classmethod
    def of(cls, graph, uids: tuple):
        """The launcher of ``graph``, or ``None`` where the frontend's dispatch must decide."""
        try:
            import cudnn
            from cudnn._handle import to_backend_handle

            if not str(getattr(cudnn, "__version__", "")).startswith(VALIDATED):
                return None  # another release: its dispatch may decide otherwise
            if not graph._is_built or graph.selected_engine is not None:
                return None  # not built yet, or a Python engine serves the plan
            lowered = graph._lowered_graph
            # the entries a call uses: a frontend without one of them keeps its own dispatch
            lowered._execute_ordered, lowered._execute_ordered_pack  # noqa: B018
            graph._finish_ordered, graph._data_bindings  # noqa: B018
            plan_index = graph._plan_index
            config = graph._materialize_backend_plan(plan_index) if graph._plans else None
            schema = graph._prepare_ordered_binding_schema()
        except (ImportError, AttributeError):  # another frontend, or not a frontend graph
            return None
        if schema is None:
            return None
        launch = cls.__new__(cls)
        launch.graph, launch.uids, launch.lowered, launch.schema = graph, uids, lowered, schema
        launch.plan_index, launch.to_backend = plan_index, to_backend_handle
        cpp_index = None if config is None else config.cpp_index
        launch.cpp_index = -1 if cpp_index is None else cpp_index
        return launch

    def __call__(self, ordered: list, workspace, handle) -> None:
        graph = self.graph
        if graph._plan_index != self.plan_index:  # another plan was selected since
            graph.execute(ordered, workspace, handle=handle, tensor_uids=self.uids)
            return
        backend = self.to_backend(handle) or 0
        result = self.lowered._execute_ordered(self.schema, ordered, self.uids,
                                               graph._data_bindings, workspace, None, None, None,
                                               backend, self.cpp_index)
        if result is not None:  # the frontend finishes the variant pack in Python
            pack = graph._finish_ordered(self.schema, result, workspace, None)
            self.lowered._execute_ordered_pack(pack.native, pack.workspace, backend,
                                               self.cpp_index)
