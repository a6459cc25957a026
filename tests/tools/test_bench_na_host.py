"""benchmarks/na_host.py on this CPU: the CuPy engine's own Python per neighborhood call, every
kernel launch stubbed (a few calls per case, in a subprocess: it patches the engine)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_na_host_times_every_problem_and_case_on_the_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "na_host.py"), "--calls", "3",
                          "--repeats", "1", "--json-to", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = tmp_path.glob("na_host-*.json")
    record = json.loads(path.read_text())
    rows = {(r["problem"], r["call"]): r for r in record["rows"]}
    problems = [p[0] for p in record["problems"]]
    assert set(rows) == {(p, c) for p in problems for c in ("fwd", "fwd (grad)", "fwd+bwd")}
    for problem in problems:
        assert rows[problem, "fwd"]["device"] == "cpu (launches stubbed)"
        # the backward's Python (delta, dQ, dK/dV launches, autograd) runs on top of a forward
        assert rows[problem, "fwd+bwd"]["us_per_call"] > rows[problem, "fwd"]["us_per_call"] > 0
