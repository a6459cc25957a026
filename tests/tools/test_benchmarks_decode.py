"""benchmarks/decode_repeatable.py on CPU: without CUDA it says so, exits 0 and writes nothing
(the two-row route it times is tested in tests/engines/test_repeatable_decode.py)."""

import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "decode_repeatable.py"


def test_quick_run_without_cuda_exits_zero_and_writes_nothing(tmp_path):
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--results-dir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout and "Nothing was run or written" in done.stdout
    assert not (tmp_path / f"decode_repeatable-{day}.json").exists()
