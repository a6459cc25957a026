"""A pytest plugin: every test runs with the cuDNN stand-in installed, CPU tensors counting as
device tensors, so the calls cuDNN takes run the cuDNN engine's host logic on this CPU.

``tests/cudnn_fake.py`` computes, in float64, each graph the engine hands cuDNN (its serialized
form: masks, score_mod programs, padding, ragged offsets, page tables, the two-row decode graph),
and length/offset tensors are runtime values, so the native varlen and KV-cache routes run as
on a GPU. Dropout stays on the other engines (the stand-in draws no Philox stream, and a test
may check the pattern a call returns). The summary counts the tests that ran cuDNN graphs and
lists the commonest reasons cuDNN declined a problem (counted each time one is checked).

The peer runners load it with ``--engine cudnn-standin``; on this repository's own tests::

    PYTHONPATH=tests python -m pytest -p cudnn_standin tests/surfaces

(tests that assert which engine a CPU call selects then see cuDNN, and fail for that reason).
``CUDNN_STANDIN_BUCKETS=all`` runs every call that can on its length bucket's graph
(``graphs.length_buckets``) from the first, not after the churn: the peer's tests then check
the buckets' padding, slicing and gradients.
"""

from __future__ import annotations

import collections
import os
import re

import pytest
import torch

import cudnn_fake
from cudnn_attn.core import dispatch
from cudnn_attn.graphs import length_buckets
from cudnn_attn.model import masks
from cudnn_attn.packed import calls

SERVED = {"cudnn": 0, "other": 0, "buckets": 0}
DECLINED: collections.Counter = collections.Counter()  # reasons, numbers blanked


def _supports(engine, problem):
    reasons = engine.graph_reasons(problem)
    if problem.dropout_p > 0:
        reasons = reasons + ["the stand-in draws no Philox stream"]
    DECLINED.update({re.sub(r"[0-9]+", "N", r.splitlines()[0])[:110] for r in reasons})
    return reasons


@pytest.fixture(autouse=True)
def _cudnn_standin(monkeypatch):
    monkeypatch.setattr(masks, "_runtime_lengths", lambda value: isinstance(value, torch.Tensor))
    monkeypatch.setattr(calls, "on_accelerator", lambda t: isinstance(t, torch.Tensor))
    _, built = cudnn_fake.install(monkeypatch)
    engine = dispatch.get_backend("cudnn")
    monkeypatch.setattr(engine, "supports", lambda problem: _supports(engine, problem))
    bucketed = []
    moved = length_buckets.BucketPlan._moved

    def spy(plan, *args):
        bucketed.append(True)
        return moved(plan, *args)

    monkeypatch.setattr(length_buckets.BucketPlan, "_moved", spy)
    if os.environ.get("CUDNN_STANDIN_BUCKETS") == "all":  # every call that can, from the first
        monkeypatch.setattr(length_buckets, "BUCKET_AFTER", 0)
    yield
    SERVED["cudnn" if built else "other"] += 1
    SERVED["buckets"] += bool(bucketed)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"cuDNN stand-in: {SERVED['cudnn']} tests ran cuDNN graphs, "
                                f"{SERVED['other']} other engines only; "
                                f"{SERVED['buckets']} ran length buckets' graphs")
    for reason, n in DECLINED.most_common(10):
        terminalreporter.write_line(f"  cuDNN declined {n} problems: {reason}")
