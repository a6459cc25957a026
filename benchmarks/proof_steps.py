"""gpu_proof's steps: commands run with deadlines, each in a process group that dies with it.

A step runs in a new session (its own process group). At its deadline its process gets SIGINT
(pytest then ends its xdist workers and writes its junit XML, the selftest stops its engines and
writes its table), ``INT_GRACE_S`` later its whole group SIGTERM, ``TERM_GRACE_S`` later SIGKILL;
the steps due at the same moment go down the ladder together.
When a step ends, by itself or not, whatever is left of its group (a process a killed
``compute-sanitizer`` left behind, an xdist worker) is ended too, so nothing of one step keeps
the GPU busy into the next. Side-by-side steps share the cores: each process gets
``cores // processes`` threads.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIN_START_S = 20.0  # a step with less time than this left is not started
INT_GRACE_S = 12.0  # SIGINT, then SIGTERM this much later (xdist waits 10 s for its workers)
TERM_GRACE_S = 5.0  # SIGTERM, then SIGKILL this much later
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the group before giving up on it
LADDER_S = INT_GRACE_S + TERM_GRACE_S + KILL_WAIT_S  # the most a cut step outlives its deadline
LADDER = ((signal.SIGINT, INT_GRACE_S), (signal.SIGTERM, TERM_GRACE_S),
          (signal.SIGKILL, KILL_WAIT_S))
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "TORCHINDUCTOR_COMPILE_THREADS")


@dataclass
class Step:
    """One command of the run: ``phase`` 1 steps run side by side, later phases one at a time.

    ``processes``: how many busy processes it runs (xdist workers, selftest engines), for the
    thread split. ``share_s``: run one after another, the seconds kept for it however long the
    steps before it take."""

    name: str
    argv: list[str]
    phase: int
    cap_s: float
    env: dict[str, str] = field(default_factory=dict)
    optional: bool = False  # a timeout or no time to start is no failure (extra rows)
    processes: int = 1
    share_s: float = 0.0


@dataclass
class StepResult:
    name: str
    command: str
    returncode: int | None = None  # None: not started, or cut at its deadline
    seconds: float = 0.0
    timed_out: bool = False
    not_started: str | None = None  # why, when it never ran
    log_tail: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    optional: bool = False
    signals: list[str] = field(default_factory=list)  # what its deadline sent, in order
    leftovers: int = 0  # processes of its group still alive when it ended, then killed
    threads: int | None = None  # OMP_NUM_THREADS and the like, per process

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def failed(self) -> bool:
        """Not ok, unless an optional step merely ran out of time."""
        return not self.ok and not (self.optional and (self.timed_out or self.not_started))


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel whether the group still exists
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(pgid: int, term_wait_s: float = 2.0, kill_wait_s: float = 3.0) -> int:
    """End whatever is left of group ``pgid`` (SIGTERM, then SIGKILL); how many were left."""
    left = group_members(pgid)
    for sig, wait in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, kill_wait_s)):
        if not group_members(pgid):
            break
        _signal_group(pgid, sig)
        until = time.monotonic() + wait
        while group_members(pgid) and time.monotonic() < until:
            time.sleep(0.05)
    return len(left)


def thread_env(threads: int) -> dict[str, str]:
    return {name: str(threads) for name in THREAD_VARIABLES}


@dataclass
class _Running:
    step: Step
    proc: subprocess.Popen
    log: Any
    log_path: Path
    started: float
    deadline: float
    threads: int
    signals: list[str] = field(default_factory=list)
    next_signal_at: float = 0.0


def _start(step: Step, work: Path, deadline: float, env: dict[str, str], cwd: Path,
           threads: int) -> _Running:
    log_path = work / f"{step.name}.log"
    log = open(log_path, "w")
    log.write(f"$ {shlex.join(step.argv)}\n")
    log.flush()
    # A new session per step: its group is what the deadline and the end of the step kill.
    proc = subprocess.Popen(step.argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            env={**env, **thread_env(threads), **step.env},
                            start_new_session=True, preexec_fn=_default_signals)
    return _Running(step, proc, log, log_path, time.monotonic(), deadline, threads)


def _default_signals() -> None:
    """In the step's process, before it runs: SIGINT and SIGTERM do what they normally do, even
    when this run was started with them ignored (``nohup``, a shell's background job); else
    the ladder's SIGINT would not reach pytest, which then writes no junit XML."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _escalate(run: _Running, now: float) -> bool:
    """Send the next signal of the ladder; False once SIGKILL's wait is over too."""
    if len(run.signals) == len(LADDER):
        return False
    sig, wait = LADDER[len(run.signals)]
    if sig == signal.SIGINT:  # the step's own process only: the pytest-xdist controller then
        run.proc.send_signal(sig)  # ends its workers and writes junit XML (all at once: none)
    else:
        _signal_group(run.proc.pid, sig)
    run.signals.append(sig.name)
    run.next_signal_at = now + wait
    return True


def tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _finish(run: _Running) -> StepResult:
    leftovers = end_group(run.proc.pid)
    run.log.close()
    cut = bool(run.signals)
    return StepResult(run.step.name, shlex.join(run.step.argv),
                      None if cut else run.proc.returncode,
                      round(time.monotonic() - run.started, 1), cut, log_tail=tail(run.log_path),
                      optional=run.step.optional, signals=run.signals, leftovers=leftovers,
                      threads=run.threads)


def _not_started(step: Step, why: str) -> StepResult:
    return StepResult(step.name, shlex.join(step.argv), not_started=why, optional=step.optional)


def run_steps(steps: list[Step], work: Path, stop_at: float, *, side_by_side: bool,
              env: dict[str, str] | None = None, cwd: Path | None = None, poll_s: float = 0.2,
              cores: int | None = None, on_result=None) -> list[StepResult]:
    """Run ``steps`` (all at once, or one after another) so that none outlives ``stop_at``
    (a ``time.monotonic()`` instant) nor its own cap by more than the signal ladder. Results
    come back in ``steps``' order; ``on_result(result)`` is called as each one ends."""
    env = dict(os.environ if env is None else env)
    cores = cores or os.cpu_count() or 1
    busy = sum(s.processes for s in steps) if side_by_side else 1
    threads = max(1, cores // busy)
    results: dict[str, StepResult] = {}
    pending, running = list(steps), []

    def record(result: StepResult) -> None:
        results[result.name] = result
        if on_result is not None:
            on_result(result)

    try:
        while pending or running:
            now = time.monotonic()
            while pending and (side_by_side or not running):
                step = pending.pop(0)
                # Run one after another, the later steps keep their shares (and a ladder each).
                kept = 0.0 if side_by_side else sum(s.share_s + LADDER_S for s in pending
                                                    if not s.optional)
                if stop_at - kept - now < MIN_START_S:
                    record(_not_started(step, "no time left in the budget"))
                    continue
                deadline = min(now + step.cap_s, stop_at - kept)
                running.append(_start(step, work, deadline, env, cwd or Path.cwd(),
                                      threads if side_by_side else cores))
            for run in list(running):
                now = time.monotonic()
                done = run.proc.poll() is not None
                if not done and now >= run.deadline and now >= run.next_signal_at:
                    done = not _escalate(run, now)  # past SIGKILL's wait: stop waiting on it
                if done:
                    record(_finish(run))
                    running.remove(run)
            if running:
                time.sleep(poll_s)
    except BaseException:  # our own SIGINT/SIGTERM: cut every step at once, keep what they wrote
        for run in running:
            run.deadline = 0.0
            run.proc.send_signal(signal.SIGINT)
            run.signals.append("SIGINT")
        time.sleep(min(2.0, INT_GRACE_S))
        for run in running:
            record(_finish(run))
        for step in pending:
            record(_not_started(step, "the run was interrupted"))
        raise
    return [results[s.name] for s in steps]
