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

from typing import Any

import sys

import torch

from .cases import Case, grid
from .checks import Outcome, run_case
from .report import SelftestReport

__all__ = ["selftest", "SelftestReport", "Outcome", "Case", "grid", "DTYPES"]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


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


def _progress(total: int, enabled: bool):
    """A tqdm bar when tqdm is installed, else a one-line counter on stderr (or nothing)."""
    if not enabled:
        return lambda label: None
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="case", leave=False)

        def step(label):
            bar.set_description_str(label[:40])
            bar.update()
            if bar.n == total:
                bar.close()
        return step
    except ImportError:
        done = [0]

        def step(label):
            done[0] += 1
            end = "\n" if done[0] == total else ""
            sys.stderr.write(f"\rselftest {done[0]}/{total} {label[:50]:<50}{end}")
            sys.stderr.flush()
        return step


def selftest(backends: Any = None, dtypes: Any = None, quick: bool = True, progress: bool = True,
             cases: Any = None) -> SelftestReport:
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
        progress: show a progress bar on stderr.
        cases: an explicit list of :class:`Case` (default: ``grid(quick)``).

    Returns:
        a :class:`SelftestReport` (``.ok``, ``.table()``, ``.to_json(path)``).
    """
    from cudnn_attn import _env
    from cudnn_attn.dispatch import BACKEND_NAMES, get_backend

    requested = backends is not None
    names = _resolve(backends or BACKEND_NAMES, BACKEND_NAMES, "backends")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = _resolve(dtypes or _default_dtypes(device, quick), DTYPES, "dtypes")
    unavailable = {n: get_backend(n).availability() for n in names}
    runnable = [n for n in names if not unavailable[n]]
    unavailable = {n: r for n, r in unavailable.items() if r}
    cases = list(cases) if cases is not None else grid(quick)
    runs = [(c, b, d) for c in cases for b in runnable for d in chosen]
    step = _progress(len(runs), progress)
    outcomes = []
    for case, backend, dtype in runs:
        outcomes.append(run_case(case, backend, DTYPES[dtype], device))
        step(f"{backend} {dtype} {case.name}")
    settings = {"quick": quick, "backends": names, "requested": requested, "dtypes": chosen, "device": str(device),
                "forward_limit": 2.0, "backward_limit": 3.0}
    return SelftestReport(outcomes, unavailable, _env.collect(), settings)
