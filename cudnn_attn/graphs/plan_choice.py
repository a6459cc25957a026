"""Which engine cuDNN picked for a built graph: its engine id, knobs and kernel.

``selected_engine(graph)`` reads it from a ``cudnn.pygraph`` after ``build_plans()`` (on a GPU
or deviceless); ``BuiltGraph.engine`` keeps it, so the graph cache, its files, ``explain()`` and
``cudnn-attn explain --target`` can show it::

    engine 9 [KERNEL_CFG=1, STREAM_K=0, TILE_CGA_M=0, TILE_M=3, TILE_N=2]
      kernel cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_1_64x128x128_...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["EngineChoice", "selected_engine", "engine_at"]


@dataclass(frozen=True)
class EngineChoice:
    """``engine_id`` and ``knobs`` (sorted ``(name, value)`` pairs: what
    ``create_execution_plan(engine_id, knobs)`` replays), cuDNN's ``plan_name``
    (``eng9_k24=1_...``), and ``kernels``: the kernels the plan launches, when known (recorded
    by the deviceless driver stand-in), else empty."""

    engine_id: int
    knobs: tuple = ()
    plan_name: str = ""
    kernels: tuple = ()
    # Chosen by timing every plan (graphs.autotune): ((plan index, ms), ...) of the plans timed;
    # empty: cuDNN's heuristic choice.
    timings: tuple = ()

    def __str__(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in self.knobs)
        tuned = f" (fastest of {len(self.timings)} timed plans)" if self.timings else ""
        return f"engine {self.engine_id} [{knobs}]{tuned}" + "".join(f"\n  kernel {k}"
                                                                    for k in self.kernels)

    @property
    def autotuned(self) -> bool:
        return bool(self.timings)

    def to_json(self) -> dict:
        return {"engine_id": self.engine_id, "knobs": [list(kv) for kv in self.knobs],
                "plan_name": self.plan_name, "kernels": list(self.kernels),
                "timings": [list(t) for t in self.timings]}

    @classmethod
    def from_json(cls, data: Optional[dict]) -> Optional["EngineChoice"]:
        if not data:
            return None
        return cls(int(data["engine_id"]), tuple((str(k), int(v)) for k, v in data["knobs"]),
                   str(data.get("plan_name", "")), tuple(data.get("kernels", ())),
                   tuple((int(i), float(ms)) for i, ms in data.get("timings", ())))


def selected_engine(graph) -> Optional[EngineChoice]:
    """The engine of ``graph``'s built plan (``None`` if the frontend does not say which).

    ``build_plans()`` walks the ranked plans and keeps the first that builds; frontend 1.32's
    ``pygraph`` records that entry's index (``_plan_index``; no public accessor). Never raises:
    the answer is informational and must not fail a build."""
    index = getattr(graph, "_plan_index", None)
    if not isinstance(index, int):
        return None
    return engine_at(graph, index)


def engine_at(graph, index: int) -> Optional[EngineChoice]:
    """The engine of ``graph``'s ranked plan ``index`` (``None`` if the frontend does not say);
    never raises."""
    try:
        engine_id, knobs = graph.get_engine_and_knobs_at_index(index)
        pairs = tuple(sorted((getattr(k, "name", str(k)), int(v))
                             for k, v in dict(knobs).items()))
        return EngineChoice(int(engine_id), pairs, str(graph.get_plan_name_at_index(index)))
    except Exception:  # a plan kind without an (engine, knobs) pair
        return None
