"""One order of cuDNN build stages for every graph (``graphs.build_stages``), one uid space."""

from __future__ import annotations

import pytest

cudnn = pytest.importorskip("cudnn")

from cudnn_attn.graphs._emit import UID  # noqa: E402
from cudnn_attn.graphs.build_stages import GraphRefused, run_build_stages  # noqa: E402

STAGES = ["validate", "build_operation_graph", "create_execution_plans", "check_support",
          "build_plans"]


class RecordingGraph:
    """Records the stages called; raises cuDNN's refusal at ``refuse_at``."""

    def __init__(self, refuse_at=None):
        self.calls, self.refuse_at = [], refuse_at

    def __getattr__(self, stage):
        if stage not in STAGES:
            raise AttributeError(stage)

        def call(*args):
            self.calls.append(stage)
            if stage == self.refuse_at:
                raise cudnn.cudnnGraphNotSupportedError(f"no engine for {stage}")
        return call


def test_every_stage_runs_in_order():
    g = RecordingGraph()
    run_build_stages(g)
    assert g.calls == STAGES


@pytest.mark.parametrize("plans, build, expected", [(False, True, STAGES[:1]),
                                                    (True, False, STAGES[:4])])
def test_stopping_points(plans, build, expected):
    g = RecordingGraph()
    run_build_stages(g, plans=plans, build=build)
    assert g.calls == expected


@pytest.mark.parametrize("stage", STAGES)
def test_a_refusal_names_its_stage_and_keeps_cudnns_error(stage):
    g = RecordingGraph(refuse_at=stage)
    with pytest.raises(GraphRefused) as info:
        run_build_stages(g)
    assert info.value.stage == stage
    assert isinstance(info.value.error, cudnn.cudnnGraphNotSupportedError)
    assert g.calls == STAGES[:STAGES.index(stage) + 1]


def test_other_errors_pass_through_and_the_second_validator_runs_after_validate():
    g, seen = RecordingGraph(), []

    def second_validator():
        seen.append(list(g.calls))
        raise KeyError("a bug, not a refusal")

    with pytest.raises(KeyError):
        run_build_stages(g, after_validate=second_validator)
    assert seen == [["validate"]]


def test_uids_are_one_space_without_aliases():
    # An IntEnum member with an existing value silently becomes an alias of the first one: the
    # FP8 graphs' uids once reused the dropout seed's number.
    assert len(set(UID)) == len(UID.__members__)
    from cudnn_attn.graphs import fp8
    assert fp8.UID is UID
    # the scale inputs take FP8_SCALES + i: no other uid may sit in that range
    scale_uids = range(UID.FP8_SCALES, UID.FP8_SCALES + len(fp8.BACKWARD_SCALES))
    assert not [u for u in UID if u in scale_uids and u is not UID.FP8_SCALES]
