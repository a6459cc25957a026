"""``cudnn_attn.selftest()`` / ``cudnn-attn selftest``: is every engine right on this machine?

(The package is ``verify`` so that ``cudnn_attn.selftest`` can be the function.)

For every engine that can run here, every feature (masks, biases, softcap, dropout, GQA, varlen,
paged KV, neighborhoods with RPB, head dims 32..256) runs forward and backward against a float64
oracle, with FlashAttention's tolerance rule (at most 2x / 3x the naive computation's error).
Declines are listed with their reasons; only wrong answers, crashes and non-repeatable results
fail.

    report = cudnn_attn.selftest(quick=True)
    print(report.table())
    assert report.ok
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from .cases import Case, grid
from .checks import Outcome
from .progress import progress_reporter
from .report import SelftestReport
from .runs import DTYPES, judge_runs, plan_runs
from .stream import ResultStream

__all__ = ["selftest", "SelftestReport", "Outcome", "Case", "grid", "DTYPES"]


def _default_dtypes(device: torch.device, quick: bool) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("float16", "bfloat16") if quick else ("float16", "bfloat16", "float32")
    return ("float32", "bfloat16") if quick else tuple(DTYPES)


def _resolve(names, known: dict | tuple, what: str) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{what} must be among {', '.join(known)}; got {', '.join(unknown)}")
    return names


def selftest(backends: str | Sequence[str] | None = None, dtypes: str | Sequence[str] | None = None,
             quick: bool = True, progress: bool = True, cases: Iterable[Case] | None = None,
             stream: str | os.PathLike[str] | None = None, isolate: bool = False,
             case_timeout_s: float | None = None) -> SelftestReport:
    """Check every engine that can run on this machine against the float64 oracle.

    Args:
        backends: engine names (``"cudnn"``, ``"cupy"``, ``"torch"``) or None for all that are
            available here. An engine named here that cannot run on this machine makes the
            report fail (it was asked to be checked); with None it is only listed.
        dtypes: names among float16/bfloat16/float32/float64; None: float16 and bfloat16 on a
            GPU (plus float32 with ``quick=False``), float32 and bfloat16 on the CPU (all four
            with ``quick=False``).
        quick: one small case per feature variant (under a minute on a CPU); False adds every
            head dim from 32 to 256 and larger sequences.
        progress: show progress on stderr: a bar on a terminal, else one line per verdict.
        cases: an explicit list of :class:`Case` (default: ``grid(quick)``).
        stream: a path to append every event to as it happens, one flushed JSON line each
            (:mod:`cudnn_attn.verify.stream`), so a run killed midway still says what it judged.
        isolate: judge each engine in a process of its own (side by side), so one engine's
            crash or hang (``case_timeout_s``) cannot touch the others' results; the run it
            died in fails and a fresh process goes on from the next one.
        case_timeout_s: with ``isolate``, the longest one run may take before its process is
            killed as hung (None: no limit).

    Returns:
        a :class:`SelftestReport` (``.ok``, ``.table()``, ``.to_json(path)``).
    """
    from cudnn_attn.core import env
    from cudnn_attn.core.dispatch import BACKEND_NAMES, get_backend

    requested = backends is not None
    names = _resolve(backends or BACKEND_NAMES, BACKEND_NAMES, "backends")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = _resolve(dtypes or _default_dtypes(device, quick), DTYPES, "dtypes")
    cases = list(cases) if cases is not None else grid(quick)
    settings = {"quick": quick, "backends": names, "requested": requested, "dtypes": chosen,
                "device": str(device), "forward_limit": 2.0, "backward_limit": 3.0,
                "isolated": isolate}
    if isolate:
        from .isolated import run_isolated

        return run_isolated(names, chosen, cases, settings=settings, environment=env.collect(),
                            stream=stream, progress=progress, case_timeout_s=case_timeout_s)
    unavailable = {n: get_backend(n).availability() for n in names}
    runnable = [n for n in names if not unavailable[n]]
    unavailable = {n: r for n, r in unavailable.items() if r}
    runs = plan_runs(cases, chosen)
    report = progress_reporter(len(runs) * len(runnable), progress)
    environment = env.collect()
    sink = ResultStream(stream) if stream is not None else None
    outcomes = []
    try:
        if sink is not None:
            sink.write("selftest", settings=settings, environment=environment)
        for name in names:
            if sink is not None:
                sink.write("engine", backend=name, unavailable=unavailable.get(name, []),
                           runs=len(runs), start=0, device=str(device))
            if name in runnable:
                outcomes += judge_runs(name, runs, device, sink, report)
                if sink is not None:
                    sink.write("end", backend=name)
    finally:
        if sink is not None:
            sink.close()
    return SelftestReport(outcomes, unavailable, environment, settings)
