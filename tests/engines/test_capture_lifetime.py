"""What a CUDA-graph capture reads from the package's caches outlives the caches (a captured
graph reads the same memory on every replay; an evicted entry would hand it back to the
allocator for the next tensor): device constants (positions, zeros) and static ``Padding``
lengths, read under a capture, stay alive after every cache is cleared, and those no capture
read do not. The capture is simulated on this CPU (``core.probe.capturing``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.core import probe
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.graphs import _runtime
from cudnn_attn.graphs._spec import analyze
from cudnn_attn.model import inputs
from cudnn_attn.model.problem import AttnProblem
from test_cudnn_host_path import fake  # noqa: F401  (fixture: the fake engine)

CPU = torch.device("cpu")


def _freed_after_clearing(value_of) -> bool:
    """Whether what ``value_of()`` returns is freed once the caches are cleared."""
    alive = weakref.ref(value_of())
    clear_caches()
    gc.collect()
    return alive() is None


@pytest.fixture
def capture(monkeypatch):
    """``capture(True)``: from now on torch's current stream is "being captured"."""
    clear_caches()
    yield lambda on: monkeypatch.setattr(probe, "capturing", lambda: on)
    clear_caches()


@pytest.mark.parametrize("constant", [
    lambda: inputs.row_positions(11, CPU, torch.int32, "bshd"),
    lambda: inputs.position_index(13, CPU),
    lambda: inputs.full_lengths(3, 2, CPU),
    lambda: inputs.scalar_zero(torch.empty(1, dtype=torch.float16)),
], ids=["row positions", "position index", "full lengths", "zero"])
def test_a_device_constant_a_capture_read_outlives_its_cache(constant, capture):
    made = constant()  # outside the capture: made and cached (the warm-up)
    assert constant() is made
    del made
    assert _freed_after_clearing(constant)  # no capture read it: the cache held it alone
    made = constant()
    capture(True)
    assert constant() is made  # read by the capture
    capture(False)
    del made
    assert not _freed_after_clearing(constant)


def test_static_padding_lengths_a_capture_read_outlive_their_cache(capture):
    q = torch.empty(2, 2, 8, 16, dtype=torch.float16)
    problem = AttnProblem.from_tensors(q, q, q, mask=ca.Padding([5, 1]))
    spec, reasons = analyze(problem)
    assert not reasons
    fresh = _runtime.LengthCache(spec)
    seq_q = fresh.get((5, 1), (5, 1), CPU)[0]
    alive = weakref.ref(seq_q)
    del seq_q, fresh
    clear_caches()
    gc.collect()
    assert alive() is None  # no capture read them
    fresh = _runtime.LengthCache(spec)
    fresh.get((5, 1), (5, 1), CPU)
    capture(True)
    seq_q = fresh.get((5, 1), (5, 1), CPU)[0]
    capture(False)
    alive = weakref.ref(seq_q)
    del seq_q, fresh
    clear_caches()
    gc.collect()
    assert alive() is not None


def test_a_runners_static_lengths_a_capture_used_outlive_the_runner(fake, capture):
    from cudnn_attn import api

    q = torch.randn(2, 2, 8, 16).to(torch.float16)

    def bound_lengths(under_capture: bool):
        """The weak reference to the lengths a fresh runner bound, after a call (under a
        capture or not) and the caches cleared."""
        clear_caches()
        ca.attention(q, q, q, mask=ca.Padding([5, 1]), backend="cudnn")  # the runner made
        (runner,) = [api._DIRECT.get(key) for key in api._DIRECT.keys()]
        alive = weakref.ref(runner.extras.lengths[0])
        capture(under_capture)
        ca.attention(q, q, q, mask=ca.Padding([5, 1]), backend="cudnn")  # through the runner
        capture(False)
        del runner
        clear_caches()
        gc.collect()
        return alive

    assert bound_lengths(False)() is None
    assert bound_lengths(True)() is not None
