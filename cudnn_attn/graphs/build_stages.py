"""The frontend's build stages, run in one order for every graph the engine builds.

``validate`` -> ``build_operation_graph`` -> ``create_execution_plans([A, FALLBACK])`` ->
``check_support`` -> ``build_plans``. Where a graph stops depends on why it is built: checking an
expression needs only ``validate`` (no device), a deviceless plan stops after ``check_support``
or builds against a described GPU, an execution builds everything. A refusal says which stage
refused, because "validate rejected it" and "no engine of this GPU runs it" are different answers.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ._emit import cudnn_module

__all__ = ["GraphRefused", "run_build_stages"]


class GraphRefused(Exception):
    """cuDNN refused a graph: ``stage`` is the step that raised, ``error`` cuDNN's own exception
    (``cudnn.cudnnGraphNotSupportedError``)."""

    def __init__(self, stage: str, error: Exception):
        super().__init__(f"{stage}: {error}")
        self.stage, self.error = stage, error


def run_build_stages(graph: Any, *, plans: bool = True, build: bool = True,
                     after_validate: Optional[Callable[[], Any]] = None) -> None:
    """Run ``graph``'s stages: ``validate`` (then ``after_validate()``, e.g. a second validator),
    the plan stages when ``plans``, ``build_plans`` only when ``build`` too. Raises
    ``GraphRefused`` when cuDNN declines at some stage; other errors pass through."""
    cd = cudnn_module()
    stage = "validate"
    try:
        graph.validate()
        if after_validate is not None:
            after_validate()
        if not plans:
            return
        stage = "build_operation_graph"
        graph.build_operation_graph()
        stage = "create_execution_plans"
        graph.create_execution_plans([cd.heur_mode.A, cd.heur_mode.FALLBACK])
        stage = "check_support"
        graph.check_support()
        if build:
            stage = "build_plans"
            graph.build_plans()
    except cd.cudnnGraphNotSupportedError as exc:
        raise GraphRefused(stage, exc) from exc
