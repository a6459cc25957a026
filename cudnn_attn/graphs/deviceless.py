"""cuDNN execution plans without a GPU, for a described device.

cuDNN answers "does an engine run this graph on that GPU?" on a CPU: a graph built with
``device_property`` (a ``targets.DeviceTarget``) runs all five build stages -- validate,
build_operation_graph, create_execution_plans([A, FALLBACK]), check_support, build_plans --
against the description, with the driver stand-in (``driver_standin``) in place of
``libcuda.so.1``. Nothing runs; the built plan names the engine and knobs cuDNN picked and the
kernels it would launch, and it serializes (``BuiltGraph.serialize``) for a GPU to load later.

``validate()`` alone is not this check: it passes graphs that no engine of the architecture can
run. Use ``plan_problem`` for a problem (the graphs the engine emits for it) and ``plan_spec`` for
a ``GraphSpec`` (e.g. a new graph kind under test); both are cached per process (LRU
``cudnn.deviceless``, emptied by ``clear_caches()``)::

    from cudnn_attn.graphs import deviceless
    result = deviceless.plan_problem(problem, "h100")            # forward
    result.engine        # EngineChoice: engine 9 [KERNEL_CFG=1, ...] + kernel names
    result.refusal       # None, or the stage and cuDNN's message
    deviceless.plan_problem(problem, "a100", backward=True).ok

``prepare()`` (called by every entry point) must run before cuDNN first builds an operation
graph in the process: cuDNN remembers a failed load of its runtime-compiled engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..core.caches import LRU
from ..core.env import cudnn_version_text as version_text
from ..errors import NotSupportedError
from ..model.problem import AttnProblem
from . import driver_standin
from .cache_files import cudnn_versions
from .limits import LIMITS
from ._spec import GraphOptions, GraphSpec, analyze
from .plan_choice import EngineChoice
from .backend import graph_specs
from .sdpa import BuiltGraph, build_graph, describe_problem
from .targets import DeviceTarget, target as as_target

__all__ = ["PlanResult", "prepare", "plan_spec", "plan_problem", "graph_specs", "describe_plan"]

_RESULTS = LRU("cudnn.deviceless", 1024)


@dataclass(frozen=True)
class PlanResult:
    """One graph planned for one described device.

    ``built``: the ``BuiltGraph``, with its plan unless planned with ``build=False``
    (``None`` when refused); ``engine``: what cuDNN picked (the top-ranked plan without a
    build); ``refusal``: why cuDNN planned nothing (``"<stage>: <message>"``), else ``None``;
    ``reasons``: the engine's own declared reasons (``analyze``) when it declines before cuDNN
    is asked (``plan_problem`` only)."""

    target: str
    backward: bool
    built: Optional[BuiltGraph] = None
    refusal: Optional[str] = None
    reasons: tuple = ()

    @property
    def ok(self) -> bool:
        return self.built is not None

    @property
    def engine(self) -> Optional[EngineChoice]:
        return None if self.built is None else self.built.engine

    def __str__(self) -> str:
        what = f"{'backward' if self.backward else 'forward'} on {self.target}"
        if self.built is not None:
            return f"{what}: {self.engine}"
        if self.reasons:
            return f"{what}: declined: " + "; ".join(self.reasons)
        return f"{what}: cuDNN refused: {self.refusal}"


def prepare() -> None:
    """Load the CUDA driver or its stand-in (``driver_standin.ensure_driver``)."""
    driver_standin.ensure_driver()


def _refusal(exc: NotSupportedError) -> str:
    reasons = [r for rs in exc.reasons.values() for r in rs]
    return "; ".join(reasons) or str(exc)


def _build(problem, spec: GraphSpec, backward: bool, device: DeviceTarget,
           build: bool) -> PlanResult:
    version, floor = cudnn_versions()[0], LIMITS.deviceless_min_version
    if version is not None and version < floor:  # no engine would finalize: say why up front
        return PlanResult(device.name, backward,
                          refusal=f"planning without a GPU needs cuDNN >= {version_text(floor)} "
                                  f"(older backends finalize no SDPA engine for a described "
                                  f"device), have {version_text(version)}")
    try:  # device="meta": no tensor lives anywhere
        built = build_graph(problem, spec, backward, target=device, build_plans=build,
                            device="meta")
    except NotSupportedError as exc:
        return PlanResult(device.name, backward, refusal=_refusal(exc))
    return PlanResult(device.name, backward, built)


def _cached(problem, spec: GraphSpec, backward: bool, device: DeviceTarget,
            build: bool) -> PlanResult:
    key = (spec, backward, device.description)
    if not build:  # a built result answers a check-only question too
        found = _RESULTS.get(key + (True,))
        if found is not None:
            return found
    return _RESULTS.get_or_create(key + (build,),
                                  lambda: _build(problem, spec, backward, device, build))


def plan_spec(spec: GraphSpec, backward: bool, device: Union[str, DeviceTarget], *,
              build: bool = True) -> PlanResult:
    """Plan the graph ``spec`` emits (its backward with ``backward``) for ``device`` (a shipped
    name, a description path or a ``DeviceTarget``). ``build=False`` stops after
    ``check_support`` (about 10 ms instead of 0.3-1.5 s of CPU): the engine is then the
    top-ranked plan, not confirmed by a build. Cached per process."""
    return _cached(spec, spec, backward, as_target(device), build)


def plan_problem(problem: AttnProblem, device: Union[str, DeviceTarget], *,
                 backward: bool = False, options: Optional[GraphOptions] = None,
                 stats: Optional[bool] = None, build: bool = True) -> PlanResult:
    """Plan ``problem``'s forward graph (``backward``: its backward graph) for ``device``.

    The engine's own rules for the device's architecture come first (``analyze``): a problem it
    declines is a result with ``reasons`` and no cuDNN call. ``stats``: the forward's LSE output
    (default: as the engine builds it, when the problem needs a backward or its LSE);
    ``build``: as ``plan_spec``."""
    device = as_target(device)
    spec, reasons = analyze(problem, target_sm=device.sm, options=options, backward=backward)
    if reasons:
        return PlanResult(device.name, backward, reasons=tuple(reasons))
    if backward:
        spec = spec.backward_variant()
    else:
        spec = spec.forward_variant(problem.requires_grad or problem.return_lse
                                    if stats is None else stats)
    return _cached(problem, spec, backward, device, build)


def describe_plan(q, k, v, *, target: Union[str, DeviceTarget], backward: bool = False,
                  options: Optional[GraphOptions] = None, **call_kwargs) -> PlanResult:
    """``graphs.describe``'s arguments (plain, varlen or KV-cache calls) planned for ``target``:
    ``print()`` names the engine cuDNN picked, its knobs and kernels, or why it refused.

    Equivalent::

        problem, options = describe_problem(q, k, v, options=options, **call_kwargs)
        plan_problem(problem, target, backward=backward, options=options)
    """
    problem, options = describe_problem(q, k, v, options=options, **call_kwargs)
    return plan_problem(problem, target, backward=backward, options=options)
