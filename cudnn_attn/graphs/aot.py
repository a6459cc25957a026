"""Graph caches built ahead of time, on a machine without a GPU, for a described device.

``warm(problems, target, directory)`` plans every graph the cuDNN engine would build for each
problem (``deviceless.graph_specs``: the forward, with stats when needed, and the backward)
against the target's description, and saves them with ``GraphCache.save``: each file carries the
serialized graph with its plan (engine, knobs and kernels recorded in the payload), the key the
engine looks up on ``cuda:0``, and the target's environment (GPU name, compute capability, SM
count, this machine's cuDNN backend and frontend versions) in place of the local one.

On a GPU, ``graph_cache.load(directory)`` accepts the files only when its environment matches
exactly; the engine's first lookup of each key then deserializes the plan instead of building
one (``graph_cache.info()["builds"]`` stays 0). Another GPU (name, SM count, cuDNN version) or
another device index rejects the files or misses them, and the engine builds as usual.

Caveats: whether a plan warmed this way *executes* on a GPU is checked only by the GPU proof
(not run here); cuDNN's Python engines (FROST) are not planned deviceless, so on a card where
one would rank first (sm_100 prefill) the warmed plan is the backend engine's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Union

import torch

from ..model.problem import AttnProblem
from ._spec import GraphOptions, analyze
from .cache import GraphCache, make_key
from .deviceless import graph_specs, plan_spec
from .sdpa import BuiltGraph
from .targets import DeviceTarget, target as as_target

__all__ = ["WarmResult", "warm", "load_deviceless", "WARM_DEVICE"]

# The device the engine's keys name on a one-GPU serving process.
WARM_DEVICE = torch.device("cuda", 0)


@dataclass(frozen=True)
class WarmResult:
    """One problem's outcome: ``graphs`` (``(tag, EngineChoice)`` per graph planned) or
    ``error`` (the engine's reasons or cuDNN's refusal)."""

    problem: AttnProblem
    graphs: tuple = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def _graph_keys(problem: AttnProblem, device: DeviceTarget, options):
    spec, reasons = analyze(problem, target_sm=device.sm, options=options)
    if reasons:
        raise ValueError("; ".join(reasons))
    return [(make_key((tag, gspec), WARM_DEVICE), gspec, backward)
            for tag, gspec, backward in graph_specs(problem, spec)]


def warm(problems: Iterable[AttnProblem], target: Union[str, DeviceTarget], directory, *,
         options: GraphOptions | None = None) -> tuple[list[WarmResult], int]:
    """Plan every graph of ``problems`` for ``target`` and save them to ``directory``.

    Returns ``(results, files_written)``. A problem the engine declines on the target, or whose
    graph cuDNN refuses, is reported in its result and skipped; the others are saved."""
    device = as_target(target)
    problems = list(problems)
    cache = GraphCache(maxsize=3 * len(problems) + 1, environment=device.environment,
                       name="cudnn.aot_warm")
    results = []
    for problem in problems:
        try:
            keys = _graph_keys(problem, device, options)
        except ValueError as exc:
            results.append(WarmResult(problem, error=f"declined on {device.name}: {exc}"))
            continue
        graphs, error = [], ""
        for key, gspec, backward in keys:
            planned = plan_spec(gspec, backward, device)
            if not planned.ok:
                error = f"cuDNN refused on {device.name}: {planned.refusal}"
                break
            cache.get_or_build(key, lambda built=planned.built: built)
            graphs.append((key[0][0], planned.engine))
        results.append(WarmResult(problem, tuple(graphs), error))
    written = cache.save(directory) if len(cache) else 0
    cache.clear()
    return results, written


def load_deviceless(payload: bytes, target: Union[str, DeviceTarget]) -> BuiltGraph:
    """A cache file's payload deserialized into cuDNN without a GPU, against ``target``'s
    description (what ``BuiltGraph.from_bytes`` does on a GPU): proves the file holds a plan
    cuDNN reads back."""
    import cudnn

    from . import driver_standin

    device = as_target(target)
    meta, blob = BuiltGraph.split_payload(payload)
    with driver_standin.recording():
        graph = cudnn.pygraph(device_property=device.properties())
        graph.deserialize(blob)
    built = BuiltGraph.from_meta(graph, meta)
    return dataclasses.replace(built, target=device.name)
