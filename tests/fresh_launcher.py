"""The command line's launcher without a torch start-up per job: one fresh interpreter imports what
the launcher imports (``torch, torchvision, vistrain.jobs``, as the planner's import baseline does)
and runs each job, ``python tools/run_distributed.py ARGS`` (or another script), in its own fork of
itself, as its own process group. A fork holds the pages a fresh launcher would (the ranks it forks
measure the memory they would; the launcher still forks its CPU ranks); its output goes to files,
its exit code comes back. For jobs whose start-up is not under test: a stop signal while torch
imports, say, needs a real new process."""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = str(REPO / "tools" / "run_distributed.py")

_SERVER = """
import json, os, runpy, sys, traceback
import torch, torchvision, vistrain.jobs
from vistrain.distributed import spawn

def run(script, argv):
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0

for line in sys.stdin:
    script, argv, env, out, err = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # the job's own process group (as a shell starts a job)
        # a fork keeps only its own thread (torch's import may leave another running): count what
        # runs now as what the imports left, or the launcher would spawn its CPU ranks, not fork them
        spawn._THREADS_AT_IMPORT = spawn._thread_count()
        os.environ.update(env)
        for path in {out, err}:
            open(path, "w").close()
        for fd, path in ((1, out), (2, err)):  # appending: one file may take both
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
        sys.exit(run(script, argv))  # the interpreter's exit: atexit handlers, flushed files
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class FreshLauncher:
    """``prefix``: what the interpreter is started under (``ip netns exec NAME``, say); ``env``:
    its environment, every job's (None: this process's)."""

    def __init__(self, prefix=(), env=None):
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO,
            text=True,
        )
        self.job = None  # the pid of a job started and not yet waited for
        self._read = b""  # what the interpreter said past the last line taken

    def start(self, argv, out: Path, err: Path = None, script: str = RUN, env=None) -> None:
        """Start ``python script *argv`` (the command line's launcher by default), ``env`` added
        to its environment, its stdout written to ``out``, its stderr to ``err`` (default: ``out``)."""
        job = [str(script), list(argv), dict(env or {}), str(out), str(err or out)]
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        self.job = int(self._line(600))  # the first waits for the imports

    def wait(self, timeout: float) -> int:
        """The exit code of the job started last; fails after ``timeout`` seconds."""
        code = int(self._line(timeout))
        self.job = None
        return code

    def ended(self) -> bool:
        """Whether the job started last has ended (its exit code is there for :meth:`wait`)."""
        return self._has_line(0.0)

    def _line(self, timeout: float) -> str:
        assert self._has_line(timeout), f"no answer within {timeout} s"
        line, self._read = self._read.split(b"\n", 1)
        return line.decode()

    def _has_line(self, timeout: float) -> bool:
        """Whether the interpreter said a whole next line within ``timeout`` seconds (its pipe is
        read unbuffered, so that select sees all it said)."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._read:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            chunk = os.read(fd, 4096)
            assert chunk, f"the launcher's interpreter died (exit code {self.proc.wait()})"
            self._read += chunk
        return True

    def run(self, argv, out: Path, err: Path = None, timeout: float = 300, **kwargs) -> int:
        self.start(argv, out, err, **kwargs)
        return self.wait(timeout)

    def close(self) -> None:
        """End the interpreter; a job still running is killed (its process group)."""
        if self.job is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.job, signal.SIGKILL)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
