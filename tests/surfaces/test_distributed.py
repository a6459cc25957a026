"""Context parallelism on CPU process groups (gloo): ring attention and the neighborhood halo
exchange, 2 and 3 ranks, forward and backward against one process on the gathered tensors."""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parents[1]  # tests/, where the shared case modules live


def _worker(rank, world, init_file, out_dir):
    sys.path.insert(0, str(HERE))
    import distributed_cases

    torch.set_num_threads(1)
    # A bounded timeout: a schedule bug shows up as a failed test, not a hung suite.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for case in distributed_cases.RING + distributed_cases.HALO:
            try:
                distributed_cases.run(case, rank, world)
                results[repr(case)] = None
            except Exception:
                results[repr(case)] = traceback.format_exc()
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}-ranks")
def outcomes(request, tmp_path_factory):
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"cp{world}")
    mp.spawn(_worker, args=(world, str(out_dir / "init"), str(out_dir)), nprocs=world)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


sys.path.insert(0, str(HERE))
import distributed_cases  # noqa: E402

CASES = distributed_cases.RING + distributed_cases.HALO


@pytest.mark.parametrize("case", CASES, ids=[repr(c) for c in CASES])
def test_matches_one_process(outcomes, case):
    errors = [r[repr(case)] for r in outcomes if r.get(repr(case))]
    assert not errors, errors[0]


def test_example_runs_under_torchrun_and_checks_itself():
    import subprocess

    root = HERE.parent
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(root / "examples" / "context_parallel.py")],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ring attention, causal, 2 ranks" in done.stdout
    assert "halo exchange" in done.stdout
