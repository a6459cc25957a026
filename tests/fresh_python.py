"""``python -c CODE`` in a fresh process, without paying torch's import each time.

A test that runs many small programs, each on its own (the docs' python blocks, the examples'
``--help``), spends most of its time importing torch, ~3 s of CPU per interpreter. ``FreshPython`` keeps one
``multiprocessing`` fork server that imported torch (and nothing of the package or the tests)
and forks each program from it: a process of its own, with its own working directory,
environment, ``sys.path`` (that of ``python -c`` under that environment), ``sys.argv`` and
``__main__``, its stdout and stderr (file descriptors included) in a log file.

What differs from a new interpreter: torch and the standard modules it imports are already in
``sys.modules``, the thread count torch's OpenMP read at import is the server's (start it with
the ``OMP_NUM_THREADS`` the programs will have), and ``atexit`` handlers do not run at the end.
Stdlib only at import: this module is what the server imports besides torch.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path


def _run(code: str, cwd: str, env: dict, path: list, log: str, err_log: str | None) -> None:
    """In a child of the server: run ``code`` as ``python -c`` would; the exit code is the
    program's (1 after an uncaught exception, whose traceback goes to stderr)."""
    import traceback
    import types

    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    os.dup2(os.open(log, flags, 0o644), 1)
    os.dup2(os.open(err_log, flags, 0o644) if err_log else 1, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    sys.argv = ["-c"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            status = exit_.code or 0
        else:  # sys.exit("message"): printed, status 1
            print(exit_.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001  (reported as the interpreter would)
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class FreshPython:
    """Runs programs as ``python -c`` under one environment; see the module's docstring."""

    def __init__(self, env: dict):
        self.env = dict(env)
        probe = subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
            env=self.env, capture_output=True, text=True, check=True)
        self.path = json.loads(probe.stdout)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["torch", __name__])
        # The server starts with the first program, from this environment (what torch reads as
        # it loads, OpenMP's thread count among it).
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)
        try:
            self.run("pass", Path.cwd(), os.devnull)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def run(self, code: str, cwd, log, timeout: float = 600.0, env: dict | None = None,
            err_log=None) -> int:
        """The exit code of ``code`` run in ``cwd`` (with ``env`` added to the environment),
        its stdout in the file ``log`` and its stderr there too, or in ``err_log``; a program
        still running after ``timeout`` seconds is killed and reported as -9."""
        process = self._context.Process(
            target=_run, args=(code, str(cwd), {**self.env, **(env or {})}, self.path, str(log),
                               None if err_log is None else str(err_log)))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            return -9
        return process.exitcode

    def run_script(self, script: Path, args: list, cwd, log, **options) -> int:
        """``run`` of ``python SCRIPT ARGS...``: that argv, the script's folder first on
        ``sys.path``, the script as ``__main__``."""
        code = (f"import runpy, sys\nsys.argv = {[str(script), *args]!r}\n"
                f"sys.path[0] = {str(script.parent)!r}\n"
                f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
        return self.run(code, cwd, log, **options)
