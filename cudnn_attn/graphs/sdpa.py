"""cuDNN-frontend SDPA graphs: forward and backward builders from an ``AttnProblem``.

One emitter writes a ``GraphSpec`` (``_spec.py``) onto a graph object; it drives both the
``cudnn.pygraph`` the engine executes and, for checks without a GPU, the frontend's C++ graph
(``backend_graph(sm_version=...)``), whose validator knows each architecture's limits. Tensor
uids are fixed (``UID``), the scale is a pass-by-value input (never a float baked into the graph),
``generate_stats`` is always explicit, and the keyword arguments handed to ``sdpa`` /
``sdpa_backward`` are whitelisted, because ``pygraph`` silently swallows misspelled ones.

Build order (``build_stages``): validate -> build_operation_graph -> create_execution_plans ->
check_support -> build_plans (the last four only when the problem's tensors are on a CUDA device). A
``cudnnGraphNotSupportedError`` at any stage declines (``NotSupportedError`` with the reason);
any other exception is a bug and surfaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch

from ..errors import NotSupportedError
from ..rewrites.kv_heads import head_counts_differ, repeat_to_common_heads
from ..model.problem import AttnProblem
from .build_stages import GraphRefused, run_build_stages
from ._emit import BACKWARD_KWARGS, FORWARD_KWARGS, UID, cudnn_dtype, cudnn_module, emit, io_uids
from ._spec import Band, GraphOptions, GraphSpec, PagedKV, analyze, cudnn_reasons
from . import driver_standin
from .entry_calls import CALL_ARGS, call_problem
from . import autotune
from .ordered_launch import launcher
from .plan_choice import EngineChoice, engine_at, selected_engine

if TYPE_CHECKING:
    import os

    from cudnn import pygraph  # the cuDNN frontend's graph (an optional dependency)

    from .targets import DeviceTarget

__all__ = ["UID", "BuiltGraph", "GraphOptions", "PagedKV", "cudnn_reasons", "build_forward",
           "build_backward", "describe", "describe_problem", "validate_for", "FORWARD_KWARGS",
           "BACKWARD_KWARGS"]

# SM counts of the reference parts, for the C++ validator without a device (only the graph key
# depends on it).
_SM_COUNT = {80: 108, 86: 84, 89: 128, 90: 132, 100: 148, 103: 148, 120: 170}


# ---------------------------------------------------------------------------------------------
# built graphs
# ---------------------------------------------------------------------------------------------

@dataclass
class BuiltGraph:
    """A validated ``cudnn.pygraph`` (with plans when built on a GPU) and how to bind it.

    ``inputs`` / ``outputs``: the uids the graph binds, in the order ``execute`` takes buffers.
    ``engine``: the engine cuDNN picked (``plan_choice.EngineChoice``), once plans are built;
    ``target``: the described device's name when they were built deviceless. ``autotune``: time
    every plan on the first execution and keep the fastest (``graphs.autotune``); ``tuned``:
    that has happened (or the graph was loaded with a tuned plan).
    """

    graph: Any
    spec: GraphSpec
    backward: bool
    inputs: tuple
    outputs: tuple
    workspace_size: int = 0
    built: bool = False
    build_seconds: float = 0.0
    engine: Optional[EngineChoice] = None
    target: Optional[str] = None
    autotune: bool = False
    tuned: bool = False
    order: tuple = field(init=False)
    # how execute() runs the graph (ordered_launch.launcher), made on the first execute
    launch: Any = field(init=False, default=None, repr=False, compare=False)

    serial_kind = "cudnn_attn.sdpa"

    def __post_init__(self):
        self.order = tuple(int(u) for u in self.inputs + self.outputs)

    @property
    def uids(self) -> dict[str, int]:
        return {UID(u).name.lower(): u for u in self.order}

    def execute(self, buffers: Mapping, workspace, handle) -> None:
        """Run on ``handle``'s stream; ``buffers`` maps every uid of ``order`` to a tensor."""
        launch = self.launch
        if launch is None:
            launch = self.launch = launcher(self.graph, self.order)
        launch([buffers[u] for u in self.order], workspace, handle)

    def tune(self, buffers: Mapping, workspace_for, handle, time_ms) -> None:
        """Time every plan on ``buffers`` (``workspace_for(size)`` gives each its workspace;
        ``time_ms(fn)`` times a call) and keep the fastest: ``graphs.autotune.fastest_plan``."""
        from .autotune import fastest_plan

        ordered = [buffers[u] for u in self.order]
        graph = self.graph

        def run_at(index: int) -> None:
            graph.execute_plan_at_index(
                ordered, workspace_for(int(graph.get_workspace_size_plan_at_index(index))),
                index, handle, tensor_uids=self.order)

        best, timings = fastest_plan(graph, run_at, time_ms)
        chosen = engine_at(graph, best)
        if chosen is not None:
            kernels = self.engine.kernels if self.engine is not None else ()
            self.engine = dataclasses.replace(chosen, kernels=kernels, timings=tuple(timings))
        self.workspace_size = int(graph.get_workspace_size())
        self.launch = None  # made again for the plan now selected
        self.tuned = True

    # -- persistence through graph_cache.save/load (GPU only: needs a built plan) ------------
    def serialize(self) -> bytes:
        blob = bytes(self.graph.serialize(as_bytes=True))
        meta = json.dumps({"spec": _spec_to_json(self.spec), "backward": self.backward,
                           "inputs": [int(u) for u in self.inputs],
                           "outputs": [int(u) for u in self.outputs],
                           "workspace": self.workspace_size,
                           "engine": self.engine.to_json() if self.engine else None,
                           "target": self.target}).encode()
        return struct.pack("<I", len(meta)) + meta + blob

    @staticmethod
    def split_payload(data: bytes) -> tuple[dict, bytes]:
        """``(meta, cuDNN blob)`` of ``serialize()``'s bytes."""
        (n,) = struct.unpack_from("<I", data)
        return json.loads(data[4:4 + n]), bytes(data[4 + n:])

    @classmethod
    def from_meta(cls, graph, meta: dict) -> "BuiltGraph":
        """A built graph around a deserialized ``graph`` and its ``serialize()`` meta."""
        engine = EngineChoice.from_json(meta.get("engine"))
        return cls(graph, _spec_from_json(meta["spec"]), meta["backward"],
                   tuple(UID(u) for u in meta["inputs"]), tuple(UID(u) for u in meta["outputs"]),
                   int(graph.get_workspace_size()), True, engine=engine, target=meta.get("target"),
                   autotune=autotune.requested(), tuned=engine is not None and engine.autotuned)

    @classmethod
    def from_bytes(cls, data: bytes) -> "BuiltGraph":
        from ._runtime import handle_for

        meta, blob = cls.split_payload(data)
        graph = cudnn_module().pygraph()
        graph.deserialize(handle_for(torch.device("cuda", torch.cuda.current_device())), blob)
        return cls.from_meta(graph, meta)


def _spec_to_json(spec: GraphSpec) -> dict:
    data = dataclasses.asdict(dataclasses.replace(spec, score_mod=None))
    data["score_mod"] = None if spec.score_mod is None else spec.score_mod.to_json()
    return data


def _spec_from_json(data: dict) -> GraphSpec:
    data = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
    if data.get("band") is not None:
        data["band"] = Band(**data["band"])
    if data.get("paged") is not None:
        data["paged"] = PagedKV(**data["paged"])
    if data.get("score_mod") is not None:
        from ..model.score_mods import ScoreMod

        data["score_mod"] = ScoreMod.from_json(data["score_mod"])
    return GraphSpec(**data)


def _register() -> None:
    try:
        from .cache import register_deserializer
    except ImportError:  # the cache module is optional for the builders
        return
    register_deserializer(BuiltGraph.serial_kind, BuiltGraph.from_bytes)


_register()


def _new_graph(spec: GraphSpec, *, handle=None, sm: Optional[int] = None, cpp: bool = False,
               target=None):
    cd = cudnn_module()
    kwargs = dict(io_data_type=cudnn_dtype(spec.dtype), intermediate_data_type=cd.data_type.FLOAT,
                  compute_data_type=cd.data_type.FLOAT)
    if sm is not None:
        kwargs.update(sm_version=sm, sm_count=_SM_COUNT.get(sm, 132))
    if target is not None:  # a described device (targets.DeviceTarget): deviceless plans
        kwargs.update(device_property=target.properties(), sm_version=target.sm,
                      sm_count=target.sm_count)
    if cpp:
        return cd._pybind_module.backend_graph(name="cudnn_attn_sdpa", **kwargs)
    if handle is not None:
        kwargs["handle"] = handle
    return cd.pygraph(name="cudnn_attn_sdpa", **kwargs)


def _decline(problem, stage: str, backward: bool, exc) -> NotSupportedError:
    what = "backward" if backward else "forward"
    return NotSupportedError(problem, {"cudnn": [f"cuDNN declined the {what} graph at {stage}: "
                                                 f"{exc}"]}, forced="cudnn")


def _spec_for(problem, target_sm, options, backward: bool) -> GraphSpec:
    spec, reasons = analyze(problem, target_sm=target_sm, options=options, backward=backward)
    if reasons:
        raise NotSupportedError(problem, {"cudnn": reasons}, forced="cudnn")
    return spec  # type: ignore[return-value]  # no reasons: analyze returned a spec


def validate_for(problem: AttnProblem, target_sm: int, *, backward: bool = False,
                 options: Optional[GraphOptions] = None, stats: bool = True):
    """The frontend's C++ validator for ``target_sm`` (e.g. 80, 90), without a GPU: returns the
    validated C++ graph (``str()`` is its JSON) or raises ``NotSupportedError``."""
    spec = _spec_for(problem, target_sm, options, backward)
    spec = spec.backward_variant() if backward else spec.forward_variant(stats)
    return _validate_cpp(problem, spec, backward, target_sm)


def _validate_cpp(problem, spec: GraphSpec, backward: bool, sm: int):
    g = _new_graph(spec, sm=sm, cpp=True)
    emit(g, spec, backward)
    try:
        g.validate()
    except cudnn_module().cudnnGraphNotSupportedError as exc:
        raise _decline(problem, f"C++ validation for sm_{sm}", backward, exc) from exc
    return g


def build_graph(problem: AttnProblem, spec: GraphSpec, backward: bool, *,
                target_sm: Optional[int] = None, plans: Optional[bool] = None,
                device: Optional[torch.device] = None, target=None,
                build_plans: bool = True, tune: Optional[bool] = None) -> BuiltGraph:
    """Emit ``spec``, validate it and, on a CUDA device, build its execution plans.

    ``tune``: time every plan on the first execution and keep the fastest (default:
    ``CUDNN_ATTN_AUTOTUNE=1``; ``graphs.autotune``).

    ``target`` (a ``targets.DeviceTarget``): build the plans without a GPU, for that described
    device (``deviceless``; the driver stand-in records the kernels into ``engine``).
    ``build_plans=False`` stops after ``check_support`` (``engine``: the top-ranked plan)."""
    if plans is None:
        device = torch.device(device if device is not None else problem.device)
        plans = target is not None or (device.type == "cuda" and torch.cuda.is_available())
    start = time.perf_counter()
    handle = None
    if plans and target is None:
        from ._runtime import handle_for

        handle = handle_for(torch.device(device if device is not None else problem.device))
    recorder: Any = driver_standin.recording() if target is not None else contextlib.nullcontext([])
    check_cpp = None if target_sm is None else \
        (lambda: _validate_cpp(problem, spec, backward, target_sm))
    with recorder as kernels:
        g = _new_graph(spec, handle=handle, target=target)
        emit(g, spec, backward)
        try:
            run_build_stages(g, plans=plans, build=build_plans, after_validate=check_cpp)
        except GraphRefused as refused:
            raise _decline(problem, refused.stage, backward, refused.error) from refused.error
    built = bool(plans and build_plans)
    engine = selected_engine(g) if plans else None
    if engine is not None and kernels:
        engine = dataclasses.replace(engine, kernels=tuple(kernels))
    inputs, outputs = io_uids(spec, backward)
    return BuiltGraph(g, spec, backward, inputs, outputs,
                      int(g.get_workspace_size()) if built else 0, built,
                      time.perf_counter() - start, engine,
                      None if target is None else target.name,
                      autotune=autotune.requested() if tune is None else tune)


def build_forward(problem: AttnProblem, *, target_sm: Optional[int] = None,
                  options: Optional[GraphOptions] = None, stats: Optional[bool] = None,
                  plans: Optional[bool] = None,
                  target: Optional[DeviceTarget] = None) -> BuiltGraph:
    """The forward graph of ``problem``: ``O`` (and the fp32 ``Stats`` = LSE, ``[B, H, S_q, 1]``,
    when ``stats`` — default: the problem needs a backward or returns its LSE). ``target``: a
    described device (``targets.target``) to build the plans for without a GPU."""
    spec = _spec_for(problem, target_sm, options, False)
    if stats is None:
        stats = problem.requires_grad or problem.return_lse
    return build_graph(problem, spec.forward_variant(stats), False, target_sm=target_sm,
                       plans=plans, target=target, tune=autotune.requested(options))


def build_backward(problem: AttnProblem, *, target_sm: Optional[int] = None,
                   options: Optional[GraphOptions] = None,
                   plans: Optional[bool] = None,
                   target: Optional[DeviceTarget] = None) -> BuiltGraph:
    """The backward graph of ``problem``: ``dQ, dK, dV`` (and ``dBias`` when the bias needs a
    gradient) from ``Q, K, V, O, dO`` and the forward's ``Stats``."""
    spec = _spec_for(problem, target_sm, options, True)
    return build_graph(problem, spec.backward_variant(), True, target_sm=target_sm, plans=plans,
                       target=target, tune=autotune.requested(options))


_NOT_PROBLEM_KWARGS = ("backend", "generator")


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backward: bool = False,
             target_sm: Optional[int] = 90, options: Optional[GraphOptions] = None,
             cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
             max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
             cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
             target: Union[str, os.PathLike[str], DeviceTarget, None] = None,
             **attention_kwargs: Any) -> pygraph:
    """The validated ``cudnn.pygraph`` the cuDNN engine would build for
    ``attention(q, k, v, **attention_kwargs)`` (its backward with ``backward=True``).

    Varlen and KV-cache calls: with ``cu_seqlens_q/k`` and ``max_seqlen_q/k``, the graph of
    ``attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``:
    packed ``[total, H, D]`` tensors in cuDNN's ragged layout (``(B, H, max_seqlen, D)`` with
    ragged offsets on Q/K/V/O/Stats, the lengths as ``seq_len_q/kv``). With ``cache_seqlens``
    (and ``block_table``), the graph of ``attention_with_kvcache(q, k, v, cache_seqlens,
    block_table=...)``: ``k``/``v`` are the caches, a paged one read through cuDNN's page tables.
    Lengths, offsets and tables are graph inputs: one graph serves every batch of lengths, and
    ``meta`` length tensors are fine (``graphs.entry_calls``).

    Works without a GPU: ``q``/``k``/``v`` (and a bias) may be CPU or ``meta`` tensors. The graph
    passes ``pygraph.validate()`` and the frontend's C++ validator for ``target_sm`` (``None``:
    skip the latter). ``print()`` shows its nodes and tensors. A combination cuDNN rejects raises
    ``NotSupportedError`` with the reason.

    ``target`` (``"a100"``, ``"h100"``, ``"h200"``, ``"b200"``, a device JSON path or a
    ``targets.DeviceTarget``): the graph also gets its execution plan for that described device,
    without a GPU (``target_sm`` is then the device's); cuDNN's refusal raises
    ``NotSupportedError``. The engine cuDNN picked: ``deviceless.describe_plan(...)`` (same
    arguments) or ``graph.get_plan_name_at_index(0)``.

    Equivalent (plain call)::

        problem = AttnProblem.from_tensors(q, k, v, **attention_kwargs)
        graph = build_forward(problem, target_sm=90, options=options, plans=False).graph
    """
    problem, options = describe_problem(q, k, v, options=options, cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                        max_seqlen_k=max_seqlen_k, cache_seqlens=cache_seqlens,
                                        block_table=block_table, **attention_kwargs)
    if backward and not problem.requires_grad:
        problem = dataclasses.replace(problem, requires_grad=True)
    build = build_backward if backward else build_forward
    if target is not None:
        from .targets import target as as_target

        device = as_target(target)
        return build(problem, target_sm=device.sm, options=options, target=device).graph
    return build(problem, target_sm=target_sm, options=options, plans=False).graph


def describe_problem(q, k, v, *, options: Optional[GraphOptions] = None, **call_kwargs):
    """``(problem, options)`` that ``describe`` builds from the same arguments."""
    for name in _NOT_PROBLEM_KWARGS:
        call_kwargs.pop(name, None)
    found = call_problem(q, k, v, options=options, **call_kwargs)
    if found is not None:
        return found
    for name in CALL_ARGS:
        call_kwargs.pop(name, None)
    layout = call_kwargs.get("layout", "bhsd")
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)) \
            and head_counts_differ(q, k, v, layout):
        # H_k != H_v: attention() runs it as GQA over lcm(H_k, H_v) repeated heads (kv_heads)
        k, v = repeat_to_common_heads(q, k, v, layout)
    return AttnProblem.from_tensors(q, k, v, **call_kwargs), options
