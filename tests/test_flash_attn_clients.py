"""ring-flash-attn 0.1.8 and yunchang 0.6.4, unmodified, over 2 gloo processes on cudnn_attn:
``cudnn_attn.integrations.flash_attn.register()`` makes their ``import flash_attn`` resolve here,
and every ring/zigzag/stripe/varlen/llama3 function and yunchang's ``LongContextAttention`` (ring
degree 2) must match single-process attention in bf16, forward and backward (the cases and the
tolerance rule are in ``flash_attn_client_cases``).

Both libraries are in the ``[test]`` extra (pure Python; their only requirement is torch, since
flash-attn is an optional extra of theirs); without them this file is skipped at collection.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

# Found, not imported: both must first be imported after register() (in the workers).
if importlib.util.find_spec("ring_flash_attn") is None or importlib.util.find_spec("yunchang") is None:
    pytest.skip("needs ring-flash-attn and yunchang (the [test] extra)", allow_module_level=True)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import flash_attn_client_cases as cases  # noqa: E402

WORLD = 2


def _worker(rank, world, init_file, out_dir):
    sys.path.insert(0, str(HERE))
    import torch

    import flash_attn_client_cases

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for case in flash_attn_client_cases.CASES:
            try:
                flash_attn_client_cases.run(case, rank, world)
                results[repr(case)] = None
            except Exception:
                results[repr(case)] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fa_clients")
    mp.spawn(_worker, args=(WORLD, str(out_dir / "init"), str(out_dir)), nprocs=WORLD)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", cases.CASES, ids=[f"{n}-{s}-{'causal' if c else 'full'}"
                                                   for n, s, c in cases.CASES])
def test_client_matches_one_process(outcomes, case):
    errors = [r.get(repr(case), "not run") for r in outcomes]
    errors = [e for e in errors if e]
    assert not errors, errors[0]
