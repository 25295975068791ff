"""Jobs on real processes for the tests of stop signals and of one line per job: a job started as
its own process group (as a shell or a scheduler starts it), SLURM's srun and scontrol played by
scripts, the losses a run logged."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = str(REPO / "tools" / "run_distributed.py")
HANG = 300  # a healthy tiny job ends long before; only a hung one reaches this
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")

# srun on one node: SLURM_NTASKS copies of the command with srun's task variables; with
# --kill-on-bad-exit the first task to fail ends the others (SIGTERM), as srun does
FAKE_SRUN = """#!/bin/bash
kill_on_bad=0
while [[ "$1" == --* ]]; do [[ "$1" == --kill-on-bad-exit* ]] && kill_on_bad=1; shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
status=0
for ((n = 0; n < SLURM_NTASKS; n++)); do
    wait -n; code=$?
    if [ $code -ne 0 ]; then
        [ $status -eq 0 ] && status=$code
        [ $kill_on_bad -eq 1 ] && kill -TERM "${pids[@]}" 2>/dev/null
    fi
done
exit $status
"""
FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'


def job_env(**extra) -> dict:
    """This checkout first on the path, one thread per rank, no job variables from outside."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def slurm_env(tmp_path: Path, tasks: int = 2, **extra) -> dict:
    """srun's job variables for one node of ``tasks`` tasks, srun and scontrol (which records its
    arguments in ``tmp_path/scontrol.log``) on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return job_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_NTASKS=str(tasks),
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_TASKS_PER_NODE=str(tasks),
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_JOB_ID=str(free_port_between(21000, 40000) - 20000),  # rendezvous port: 20000 + id
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        **extra,
    )


def free_port_between(low: int, high: int) -> int:
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:  # nobody listens there
                return port
    raise RuntimeError(f"no free port in [{low}, {high})")


class Job:
    """A job started as its own process group; its output goes to files next to ``run_dir``."""

    def __init__(self, command, run_dir: Path, env: dict):
        self.run_dir, self.env = run_dir, env
        self.out, self.err = run_dir.parent / f"{run_dir.name}.out", run_dir.parent / f"{run_dir.name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                command, env=env, stdout=out, stderr=err, cwd=REPO, start_new_session=True
            )

    def wait_for_iteration(self, iteration: int) -> int:
        """Block until metrics.jsonl logged ``iteration`` (or more); returns the latest logged."""
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            logged = last_iteration(self.run_dir)
            if logged >= iteration:
                return logged
            assert self.proc.poll() is None, f"the job ended early:\n{self.err.read_text()[-3000:]}"
            time.sleep(0.05)
        raise AssertionError("the job made no progress")

    def wait_until_hanging(self) -> None:
        """Block until rank 0 is inside the step that ``STOP_JOB_HANG_AT`` hangs (tests/stop_job.py):
        a signal sent earlier can still find the iteration boundary before that step and stop there."""
        deadline = time.monotonic() + HANG
        while not (self.run_dir / "hanging0").exists():
            assert time.monotonic() < deadline, "rank 0 never reached the step it hangs in"
            assert self.proc.poll() is None, f"the job ended early:\n{self.err.read_text()[-3000:]}"
            time.sleep(0.05)

    def pid(self, rank: int) -> int:
        """The pid rank ``rank`` wrote into the run folder (tests/stop_job.py)."""
        return int((self.run_dir / f"pid{rank}").read_text())

    def finish(self, since=None):
        """(exit code, stderr lines, seconds since ``since``)."""
        try:
            self.proc.wait(timeout=HANG)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        took = time.monotonic() - since if since is not None else 0.0
        return self.proc.returncode, self.err.read_text().splitlines(), took

    def outlived_by(self, seconds: float) -> bool:
        """Whether any process of the job (a rank, a DataLoader worker, multiprocessing's resource
        tracker) still lives ``seconds`` after the launcher exited (call after :meth:`finish`)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return False
            time.sleep(0.05)
        os.killpg(self.proc.pid, signal.SIGKILL)
        return True


class ForkedJob(Job):
    """A :class:`Job` of ``python script ARGS`` forked by ``launcher`` (tests/fresh_launcher.py:
    no torch start-up of its own), its own process group too; ``env``: added to the launcher's."""

    def __init__(self, launcher, script: str, args, run_dir: Path, env: dict):
        self.run_dir, self.env = run_dir, env
        self.out, self.err = run_dir.parent / f"{run_dir.name}.out", run_dir.parent / f"{run_dir.name}.err"
        launcher.start(args, self.out, self.err, script=script, env=env)
        self.proc = _Forked(launcher)


class _Forked:
    """What :class:`Job` reads of a Popen, for the job a FreshLauncher started last."""

    def __init__(self, launcher):
        self.launcher, self.pid, self.returncode = launcher, launcher.job, None

    def poll(self):
        if self.returncode is None and self.launcher.ended():
            self.returncode = self.launcher.wait(0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self.launcher.wait(HANG if timeout is None else timeout)
        return self.returncode


def last_iteration(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["iteration"] if lines else 0


def losses(run_dir: Path) -> dict:
    """iteration -> loss; a re-done iteration's latest record counts."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records}
