"""benchmarks/sanitize.py's cases feed the kernels only memory that initcheck sees written.

Under ``--kernel-name kns=na_`` compute-sanitizer instruments the package's kernels alone: what
torch's kernels write (fills, casts, reductions, copies on the device) is uninitialised to
initcheck, and every kernel read of it is a report. The third H200 run had 3432 such 4-byte
reads and no kernel bug behind them: dQ (560 per dtype, one per row and quad) and dK/dV (80)
read the band case's ``delta``, which the case computed with torch, and ``na_neighbor_dot`` read
the fp16/bf16 unfused case's rpb (2 x 756 = 2 x B*H*N*KK), which ``qk_forward`` casts to float
with torch. 3 x 640 + 2 x 756 = 3432.

Here every case runs on the ``meta`` device with the launches recorded instead of made: a
dispatch mode follows each storage's last writer (a copy from the host, a package kernel, or a
torch op on the device) and every pointer parameter a kernel declares ``const`` (read, from the
CUDA source) must hold memory last written by the host or by a kernel. Per tensor, not per
element: that every element a kernel reads was written is the host emulation's check
(``tests/engines/test_fused_kernels_host.py``, NaN-prefilled outputs).
"""

import re
from pathlib import Path

import pytest
import torch
from common import load_script
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from cudnn_attn.fallback_kernels import fused as F
from cudnn_attn.fallback_kernels import launch
from cudnn_attn.fallback_kernels import unfused as U

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIR = ROOT / "cudnn_attn" / "fallback_kernels"
_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?"
                     r"(na_\w+)\s*\(")
_MACRO = re.compile(r"#define\s+(NA_\w+_PARAMS)\s+((?:.*\\\n)*.*)")


def kernel_reads() -> dict:
    """kernel name -> one flag per pointer parameter, in order: True where it is ``const``."""
    found = {}
    for name in ("fused_attention.cu", "unfused.cu"):
        text = (KERNEL_DIR / name).read_text()
        macros = {m.group(1): m.group(2).replace("\\\n", " ") for m in _MACRO.finditer(text)}
        for m in _GLOBAL.finditer(text):
            depth, end = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            params = text[m.end():end - 1]
            for macro, body in macros.items():
                params = params.replace(macro, body)
            flags = [p.strip().startswith("const") for p in params.split(",") if "*" in p]
            assert found.setdefault(m.group(1), flags) == flags, m.group(1)
    return found


class Writers(TorchDispatchMode):
    """Last writer of each device storage: ``"host"`` (a copy from the CPU), ``"kernel"`` (a
    package kernel's output, set by ``wrote``) or the torch op that wrote it."""

    def __init__(self):
        super().__init__()
        self.last = {}

    @staticmethod
    def key(t):
        return StorageWeakRef(t.untyped_storage())

    def wrote(self, t, writer):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            self.last[self.key(t)] = writer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        from_host = func.overloadpacket.__name__ in ("_to_copy", "copy_", "copy") and any(
            a.device.type == "cpu" for a in flat)
        writer = "host" if from_host else f"torch {func}"
        inputs = {self.key(a) for a in flat if a.device.type == "meta"}
        schema = func._schema
        if schema.is_mutable:  # in place: the arguments it writes
            for arg, value in zip(schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    self.wrote(value, writer)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "meta" and (
                    self.key(t) not in inputs or schema.is_mutable):
                self.wrote(t, writer)  # a new storage (a view of an input keeps its writer)
        return out


@pytest.fixture(scope="module")
def S():
    return load_script(ROOT / "benchmarks" / "sanitize.py", "bench_sanitize_inputs")


@pytest.fixture
def traced(S, monkeypatch):
    """The cases' launches recorded on ``meta`` (sm_90, as on the H200): returns ``(run,
    unread, launched)``: ``run(case, fn)`` traces one case, ``unread`` lists (case, kernel,
    pointer index, writer) of const pointer arguments whose memory a kernel did not get from the
    host or another kernel, ``launched`` the kernels launched."""
    reads = kernel_reads()
    writers, unread, case, launched = Writers(), [], [None], set()

    def record(kernel, tensors):
        launched.add(kernel)
        flags = reads[kernel]
        assert len(tensors) == len(flags), kernel
        for i, (t, const) in enumerate(zip(tensors, flags)):
            if t is None:
                continue
            if const:
                who = writers.last.get(writers.key(t), "nobody")
                if who not in ("host", "kernel"):
                    unread.append((case[0], kernel, i, who))
            else:
                writers.wrote(t, "kernel")

    def fused_launch(kernel, dtype, head_dim, grid, tensors, scalars, ctx):
        record(F.expression(kernel, dtype, head_dim).split("<")[0], tensors)

    def unfused_call(self, name, grid, threads, tensors, scalars):
        tensors = [*tensors, self.table]
        if name == "na_neighbor_dot" and not scalars[3]:  # has_rpb = 0: rpb is never read
            tensors[2] = None
        record(name, tensors)

    def unchecked(name, t, rank):
        assert isinstance(t, torch.Tensor) and t.dim() == rank + 3, name

    monkeypatch.setattr(S, "DEVICE", "meta")
    monkeypatch.setattr(F, "_launch", fused_launch)
    monkeypatch.setattr(F, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(F, "_wgmma_layouts_read_right", lambda index: True)
    monkeypatch.setattr(F, "_tokens", lambda t, rank, name: F._last_contiguous(
        t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1])))
    monkeypatch.setattr(launch, "TorchStream", lambda device: _NoStream())
    # The real upload is a host-to-device copy (torch.tensor(..., device=)), which the mode does
    # not see as one; this is the same copy written as one.
    monkeypatch.setattr(launch, "device_table", lambda table, device: torch.tensor(
        tuple(table), dtype=torch.int32).to(device))
    monkeypatch.setattr(U, "_check_tensor", unchecked)
    monkeypatch.setattr(U._Launch, "__call__", unfused_call)

    def run(name, fn):
        case[0] = name
        with writers:
            fn()
    return run, unread, launched


class _NoStream:
    index, stream = 0, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_kernel_reads_come_from_the_source():
    reads = kernel_reads()
    assert reads["na_fused_backward_dq"] == [True] * 6 + [False, True]
    assert reads["na_fused_backward_delta"] == [True, True, True, False]
    assert reads["na_neighbor_dot"] == [True, True, True, False, True]
    assert set(F.KERNELS) | {"na_neighbor_dot", "na_rpb_backward"} <= set(reads)


def test_every_case_reads_only_memory_initcheck_sees_written(S, traced):
    run, unread, launched = traced
    cases = {**S._fused_cases(), **S._unfused_cases()}
    assert len(cases) == len(S.case_names())
    for name, fn in cases.items():
        run(name, fn)
    assert launched == set(kernel_reads()) - {"na_wgmma_probe"}  # every kernel ran
    assert not unread, "\n".join(map(str, unread))


def test_the_tracer_sees_a_delta_torch_computed(S, traced):
    """The check itself: a backward fed a ``delta`` that torch computed on the device is caught,
    one record per kernel that reads it (dQ and dK/dV)."""
    run, unread, _ = traced
    real = F.run_backward

    def torch_delta(q, k, v, dout, lse, delta, *rest):
        real(q, k, v, dout, lse, delta * 1.0, *rest)  # torch writes it (keeps strides)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "run_backward", torch_delta)
        run("band", S._fused_cases()["fused-fp32-band-causal-empty-rows"])
    assert [(k, i) for _, k, i, _ in unread] == [("na_fused_backward_dq", 5),
                                                 ("na_fused_backward_dkdv", 5)]
