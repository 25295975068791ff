"""SIGTERM and SIGUSR1, as schedulers send them, on real processes: every rank stops at an
iteration boundary, a checkpoint of that iteration is saved, one line names it, exit 143; the
rerun loses no iteration and its losses equal an uninterrupted run's. A step that cannot finish
within the grace is abandoned and the previous checkpoint stands. Under SLURM the job can requeue
itself; under torchrun a restart resumes the same way.

The jobs are ``tests/stop_job.py`` (the tiny recipe through the command line's launcher, hooks
in every rank: a short sleep per step gives the test a window to send its signal in).
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vistrain.distributed.testing import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
JOB = str(REPO / "tests" / "stop_job.py")
EPOCHS = 3  # x 4 iterations on 2 ranks
ITERATIONS = 4 * EPOCHS
ARGS = [f"config.OPTIMIZER.num_epochs={EPOCHS}", "config.CHECKPOINT.KEEP_LAST=10"]
STOP_LIMIT = 60  # seconds from the signal to the exit: the schedulers' grace this must fit
HANG = 300  # a healthy job ends long before; only a hung one reaches this
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


class Job:
    """A job started as its own process group (as a shell or a scheduler starts it); its output
    goes to files (no pipe to fill)."""

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
            logged = _last_iteration(self.run_dir)
            if logged >= iteration:
                return logged
            assert self.proc.poll() is None, f"the job ended early:\n{self.err.read_text()[-3000:]}"
            time.sleep(0.05)
        raise AssertionError("the job made no progress")

    def pid(self, rank: int) -> int:
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


def _last_iteration(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["iteration"] if lines else 0


def _losses(run_dir: Path) -> dict:
    """iteration -> loss; a re-done iteration's latest record counts."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records}


def _job(run_dir: Path, *overrides, step_seconds=0.0, **env) -> Job:
    command = [sys.executable, JOB, *ARGS, f"config.CHECKPOINT.DIR={run_dir}", *overrides]
    return Job(command, run_dir, _env(STOP_JOB_STEP_SECONDS=str(step_seconds), **env))


def _train(rank, world_size, argv):
    from vistrain.config import load_config
    from vistrain.training import train

    train(load_config(argv))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The losses of the uninterrupted run: 2 ranks (forked, so faster to start than the launcher's,
    and the same numbers: same seed, one thread each)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    argv = ["config=test/simclr_tiny", "config.LOG_FREQUENCY=1", *ARGS, f"config.CHECKPOINT.DIR={run_dir}"]
    run_on_ranks(_train, 2, argv)
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    return losses


def _assert_same_losses(run_dir: Path, reference: dict, until: int = ITERATIONS) -> None:
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, until + 1))
    torch.testing.assert_close(
        torch.tensor([got[i] for i in sorted(got)], dtype=torch.float64),
        torch.tensor([reference[i] for i in sorted(got)], dtype=torch.float64),
        rtol=1e-6,
        atol=1e-7,
    )


def _assert_stopped_at_a_boundary(run_dir: Path, code: int, err, took: float, sig: str) -> int:
    """One line naming the checkpoint of the iteration every rank stopped at; returns it."""
    assert code == 143, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    stopped = _last_iteration(run_dir)  # LOG_FREQUENCY 1: the stop iteration was logged first
    checkpoint = run_dir / f"checkpoint_{stopped}"
    assert err[0] == (
        f"stopped: {sig} at iteration {stopped} of {ITERATIONS}: every rank stopped and saved "
        f"checkpoint_{stopped}; rerun the same command to resume from {checkpoint}"
    )
    assert (checkpoint / "metadata.json").is_file() and (checkpoint / "rank1.pt").is_file()
    assert took < STOP_LIMIT
    return stopped


# --------------------------------------------------------------------------------------------
# the spawn launcher


def test_stop_signals_to_the_launcher_to_one_rank_and_to_every_process_lose_nothing(tmp_path, reference):
    """One run folder, stopped three times: SIGTERM to the launcher only; SIGTERM to rank 1 only;
    SIGUSR1 to every process of the job at once (as SLURM's --signal does). Every rerun resumes
    where the last one stopped, and the losses equal the uninterrupted run's."""
    run_dir, stops = tmp_path / "run", []
    targets = [
        ("SIGTERM", lambda job: os.kill(job.proc.pid, signal.SIGTERM)),
        ("SIGTERM", lambda job: os.kill(job.pid(1), signal.SIGTERM)),
        ("SIGUSR1", lambda job: os.killpg(job.proc.pid, signal.SIGUSR1)),
    ]
    for sig, send in targets:
        job = _job(run_dir, step_seconds=0.3)
        job.wait_for_iteration((stops[-1] if stops else 0) + 1)
        sent = time.monotonic()
        send(job)
        stops.append(_assert_stopped_at_a_boundary(run_dir, *job.finish(since=sent), sig))
    assert stops == sorted(stops) and stops[-1] < ITERATIONS
    log = (run_dir / "log.txt").read_text()
    for stopped in stops[:-1]:
        assert f"resumed from {run_dir / f'checkpoint_{stopped}'} at iteration {stopped}" in log
    _assert_same_losses(run_dir, reference, until=stops[-1])


def test_a_step_that_cannot_finish_within_the_grace_is_abandoned(tmp_path):
    """Rank 0 hangs in the 4th step; SIGTERM to the launcher: exit 143 within the grace (3 s here),
    one line, and checkpoint_2 (saved before) stays the latest: nothing partial replaced it."""
    run_dir = tmp_path / "run"
    job = _job(
        run_dir,
        "config.CHECKPOINT.STOP_GRACE_SECONDS=3",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
        STOP_JOB_HANG_AT="3",
    )
    job.wait_for_iteration(3)
    sent = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)
    code, err, took = job.finish(since=sent)
    assert code == 143 and len(err) == 1, err
    assert err[0] == (
        "stopped: SIGTERM: the step in progress did not end within the grace and was abandoned; "
        f"rerun the same command to resume from {run_dir / 'checkpoint_2'}"
    )
    assert took < STOP_LIMIT
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_2"]


# --------------------------------------------------------------------------------------------
# SLURM and torchrun

FAKE_SRUN = """#!/bin/bash
# stand-in for srun on one node: SLURM_NTASKS copies of the command with srun's task variables
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid"; code=$?; [ $code -ne 0 ] && status=$code; done
exit $status
"""
FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'


def _free_port_between(low: int, high: int) -> int:
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:  # nobody listens there
                return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def _slurm_env(tmp_path: Path, **extra) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_NTASKS="2",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_JOB_ID=str(_free_port_between(21000, 40000) - 20000),  # the rendezvous port is 20000 + id
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        **extra,
    )


def _srun_job(tmp_path: Path, run_dir: Path, *overrides, **env) -> Job:
    srun = ["srun", "--kill-on-bad-exit=1", sys.executable, JOB, *ARGS, f"config.CHECKPOINT.DIR={run_dir}"]
    return Job(["bash", "-c", shlex.join([*srun, *overrides])], run_dir, _slurm_env(tmp_path, **env))


def test_slurm_usr1_stops_saves_and_requeues_the_job_in_one_line(tmp_path):
    """SLURM's --signal=USR1 reaches every task: they stop at one boundary, save, rank 0 runs
    `scontrol requeue $SLURM_JOB_ID` (CHECKPOINT.SLURM_REQUEUE), one line for the job, exit 143."""
    run_dir = tmp_path / "run"
    job = _srun_job(tmp_path, run_dir, "config.CHECKPOINT.SLURM_REQUEUE=True", STOP_JOB_STEP_SECONDS="0.2")
    job.wait_for_iteration(2)
    sent = time.monotonic()
    for rank in (0, 1):
        os.kill(job.pid(rank), signal.SIGUSR1)
    code, err, took = job.finish(since=sent)
    stopped = _last_iteration(run_dir)
    requeued = job.env["SLURM_JOB_ID"]
    assert (tmp_path / "scontrol.log").read_text().splitlines() == [f"requeue {requeued}"]  # once
    assert code == 143 and len(err) == 1, err
    assert err[0] == (
        f"stopped: SIGUSR1 at iteration {stopped} of {ITERATIONS}: every rank stopped and saved "
        f"checkpoint_{stopped}; requeued SLURM job {requeued}; rerun the same command to resume from "
        f"{run_dir / f'checkpoint_{stopped}'}"
    )
    assert took < STOP_LIMIT


def test_slurm_abandoned_step_is_reported_once_by_rank_0(tmp_path):
    """No launcher watches srun's tasks: global rank 0's own grace timer prints the job's line."""
    run_dir = tmp_path / "run"
    job = _srun_job(
        tmp_path,
        run_dir,
        "config.CHECKPOINT.STOP_GRACE_SECONDS=3",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
        STOP_JOB_HANG_AT="3",
    )
    job.wait_for_iteration(3)
    sent = time.monotonic()
    os.killpg(job.proc.pid, signal.SIGTERM)  # scancel: every process of the job step
    code, err, took = job.finish(since=sent)
    assert code != 0 and len(err) == 1, err
    assert err[0] == (
        "stopped: SIGTERM: the step in progress did not end within 3 s (CHECKPOINT.STOP_GRACE_SECONDS) "
        f"and was abandoned; rerun the same command to resume from {run_dir / 'checkpoint_2'}"
    )
    assert took < STOP_LIMIT
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_2"]


def test_torchrun_restarts_workers_stopped_by_sigterm_and_loses_nothing(tmp_path, reference):
    """SIGTERM to one worker (a lost node's, say): both stop and save at one boundary, exit 143;
    torchrun --max-restarts restarts the group, which resumes there and ends like the
    uninterrupted run."""
    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*torchrun, "--max-restarts=1", JOB, *ARGS, f"config.CHECKPOINT.DIR={run_dir}"]
    job = Job(command, run_dir, _env(STOP_JOB_STEP_SECONDS="0.2"))
    job.wait_for_iteration(3)
    os.kill(job.pid(1), signal.SIGTERM)
    code, err, _ = job.finish()
    assert code == 0, err
    log = (run_dir / "log.txt").read_text()
    assert "resumed from" in log
    _assert_same_losses(run_dir, reference)
