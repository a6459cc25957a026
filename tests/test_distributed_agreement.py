"""Ranks that disagree (gloo, 2 CPU processes): every shared argument of the ring, the halo
exchange and ``unshard_sequence`` made to differ on one rank, and arguments only one rank's
validation rejects. Every rank must raise the same ``RankDisagreement`` (same message, naming the
argument) within a few seconds: no rank may hang, abort (gloo's size mismatch) or return."""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
WORLD = 2
# Far above the time a refusal takes (one all-gather), far below gloo's default 30 minutes: a
# rank left waiting on a peer shows up as a slow or failed case, not a hung suite.
GROUP_TIMEOUT_S = 20
PROMPT_S = 10.0


def _worker(rank, world, init_file, out_dir):
    sys.path.insert(0, str(HERE))
    import distributed_mismatch_cases as cases

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    results = {}
    try:
        cases.warm_up(rank, world)  # first-use imports are not what the clock below measures
        dist.barrier()
        for name, (call, _) in cases.CASES.items():
            start = time.monotonic()
            try:
                call(rank, world)
                outcome = {"returned": True}
            except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
                outcome = {"type": type(exc).__name__, "message": str(exc),
                           "trace": traceback.format_exc()}
            outcome["seconds"] = time.monotonic() - start
            results[name] = outcome
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("agreement")
    mp.spawn(_worker, args=(WORLD, str(out_dir / "init"), str(out_dir)), nprocs=WORLD)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


sys.path.insert(0, str(HERE))
import distributed_mismatch_cases  # noqa: E402

CASES = distributed_mismatch_cases.CASES


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_same_error_promptly(outcomes, name):
    expected = CASES[name][1]
    seen = [r[name] for r in outcomes]
    for rank, outcome in enumerate(seen):
        assert not outcome.get("returned"), f"rank {rank} returned a result"
        assert outcome["type"] == "RankDisagreement", f"rank {rank}: {outcome['trace']}"
        assert expected in outcome["message"], f"rank {rank}: {outcome['message']}"
        assert outcome["seconds"] < PROMPT_S, f"rank {rank} took {outcome['seconds']:.1f} s"
    assert len({o["message"] for o in seen}) == 1, [o["message"] for o in seen]


def test_the_rank_whose_validation_failed_keeps_its_reason(outcomes):
    last = outcomes[WORLD - 1]["ring-bad-layout-one-rank"]
    assert "layout must be 'bshd' or 'bhsd', got 'sbhd'" in last["trace"]  # the chained cause
