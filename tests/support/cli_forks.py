"""`llmserve` command lines run as real processes that share one interpreter start-up.

A `python -m llmserve.cli ...` pays the interpreter's start and the imports of torch and the three services (10-15 s
each on the 2-core box under load), and the files that check how command lines fail at start run dozens. Here one
process imports `llmserve.cli` and the services once; for each command line it forks a child that runs
`llmserve.cli.main(argv)` with its own stdout and stderr and /dev/null as stdin, and ends with the status the console
script would give (0, the code of a SystemExit, 1 and a traceback on an exception). The child is a separate process:
what the command does (flag checks, connecting to Redis, exiting) is real; only the imports are shared.

`run_cli(*args)` runs one in this pytest process's shared preloaded process (started at the first call, ended with
the session). The preloaded process is `python -m tests.support.cli_forks`: one JSON line in per command line
({"argv": [...], "timeout": s, "env": {...}}: the caller's environment at the call), one JSON line out
({"returncode", "stdout", "stderr"}).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CliForks:
    """The test side: one preloaded process for a module's command lines; `run(*args)` like subprocess.run."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.cli_forks"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, *args, timeout: float = 60) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        self.proc.stdin.write(json.dumps({"argv": argv, "timeout": timeout, "env": dict(os.environ)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the command-line process ended (status {self.proc.poll()}) running llmserve {argv}"
        out = json.loads(line)
        if out["returncode"] is None:
            raise subprocess.TimeoutExpired(["llmserve", *argv], timeout, out["stdout"], out["stderr"])
        return subprocess.CompletedProcess(["llmserve", *argv], out["returncode"], out["stdout"], out["stderr"])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_shared: CliForks | None = None


def run_cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`llmserve ARGS...` like subprocess.run(capture_output=True, text=True), in a process of its own."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = CliForks()
    return _shared.run(*args, timeout=timeout)


def close_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.close()
        _shared = None


def _child(argv: list[str], env: dict[str, str], out_path: str, err_path: str) -> None:
    """In the forked child: the caller's environment, the command line's own streams, then the console script's
    exit status."""
    from llmserve.cli import main

    os.environ.clear()
    os.environ.update(env)
    os.setpgid(0, 0)  # its own group: a timeout ends what it started as well
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, out_path, os.O_WRONLY), (2, err_path, os.O_WRONLY)):
        os.dup2(os.open(path, mode), fd)
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _run_one(argv: list[str], env: dict[str, str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmserve-cli-") as d:
        out_path, err_path = os.path.join(d, "out"), os.path.join(d, "err")
        open(out_path, "w").close()
        open(err_path, "w").close()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, env, out_path, err_path)
        deadline = time.monotonic() + timeout
        status = None
        while status is None and time.monotonic() < deadline:
            done, raw = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else None
            if status is None:
                time.sleep(0.02)
        if status is None:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        return {"returncode": status, "stdout": open(out_path, errors="replace").read(),
                "stderr": open(err_path, errors="replace").read()}


def serve_forever() -> None:
    import llmserve.cli

    llmserve.cli.build_parser()  # imports every subcommand's flags (and torch, through the worker's)
    import api_svc.server  # noqa: F401  (what each command's run imports: loaded once, here)
    import llmserve.serve  # noqa: F401
    import scheduler_svc.servers.process  # noqa: F401
    import worker_svc.server  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(_run_one(request["argv"], request["env"], request["timeout"])), flush=True)


if __name__ == "__main__":
    serve_forever()
