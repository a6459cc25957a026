"""cuDNN execution plans for the FP8 graphs without a GPU (``deviceless``'s machinery).

``plan_fp8(spec, backward, "h100")`` runs the build stages (``build_stages``) of
``spec``'s ``sdpa_fp8`` / ``sdpa_fp8_backward`` graph against a described device
(``targets``: ``h100``, ``h200``, ``b200``, ...), with the driver stand-in in place of
``libcuda``: the answer to "does an engine of that GPU run this FP8 graph?", which ``validate()``
alone does not give. Cached per process (LRU ``cudnn.fp8_deviceless``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..core.caches import LRU
from . import driver_standin
from .build_stages import GraphRefused, run_build_stages
from .deviceless import prepare
from .fp8 import Fp8Spec, cudnn_module, emit_fp8
from .plan_choice import EngineChoice, selected_engine
from .targets import DeviceTarget, target as as_target

__all__ = ["Fp8PlanResult", "plan_fp8"]

_RESULTS = LRU("cudnn.fp8_deviceless", 256)


@dataclass(frozen=True)
class Fp8PlanResult:
    """``engine``: what cuDNN picked (``None`` when refused); ``refusal``: ``"<stage>:
    <message>"`` when cuDNN planned nothing."""

    target: str
    backward: bool
    engine: Optional[EngineChoice] = None
    refusal: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.refusal is None


def _plan(spec: Fp8Spec, backward: bool, device: DeviceTarget, build: bool) -> Fp8PlanResult:
    cd = cudnn_module()
    prepare()
    with driver_standin.recording() as kernels:
        g = cd.pygraph(name="cudnn_attn_sdpa_fp8", io_data_type=getattr(cd.data_type, spec.io),
                       intermediate_data_type=cd.data_type.FLOAT,
                       compute_data_type=cd.data_type.FLOAT,
                       device_property=device.properties(), sm_version=device.sm,
                       sm_count=device.sm_count)
        emit_fp8(g, spec, backward)
        try:
            run_build_stages(g, build=build)
        except GraphRefused as refused:
            return Fp8PlanResult(device.name, backward, refusal=str(refused))
    engine = selected_engine(g)
    if engine is not None and kernels:
        import dataclasses

        engine = dataclasses.replace(engine, kernels=tuple(kernels))
    return Fp8PlanResult(device.name, backward, engine)


def plan_fp8(spec: Fp8Spec, backward: bool, device: Union[str, DeviceTarget], *,
             build: bool = True) -> Fp8PlanResult:
    """Plan ``spec``'s FP8 forward (``backward``: backward) graph for ``device`` without a GPU;
    ``build=False`` stops after ``check_support``. Cached per process."""
    device = as_target(device)
    key = (spec, backward, device.description, build)
    return _RESULTS.get_or_create(key, lambda: _plan(spec, backward, device, build))
