"""SIGTERM and SIGUSR1, as schedulers send them, on real processes: every rank stops at an
iteration boundary, a checkpoint of that iteration is saved, one line names it, exit 143; the
rerun loses no iteration and its losses equal an uninterrupted run's. A step that cannot finish
within the grace is abandoned and the previous checkpoint stands. Under SLURM the job can requeue
itself; under torchrun a restart resumes the same way.

The jobs are ``tests/stop_job.py`` (the tiny recipe through the command line's launcher, hooks
in every rank: a short sleep per step gives the test a window to send its signal in).
"""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fresh_launcher import FreshLauncher
from job_processes import REPO, ForkedJob, Job, job_env, last_iteration, losses, slurm_env

from vistrain.distributed.testing import run_on_ranks

JOB = str(REPO / "tests" / "stop_job.py")
EPOCHS = 3  # x 4 iterations on 2 ranks
ITERATIONS = 4 * EPOCHS
ARGS = [f"config.OPTIMIZER.num_epochs={EPOCHS}", "config.CHECKPOINT.KEEP_LAST=10"]
STOP_LIMIT = 60  # seconds from the signal to the exit: the schedulers' grace this must fit


@pytest.fixture(scope="module")
def launcher():
    """The launcher jobs below, each forked from one fresh interpreter (tests/fresh_launcher.py):
    one torch start-up for the module. The jobs that a signal hits while they start are real new
    processes."""
    with FreshLauncher(env=job_env()) as fresh:
        yield fresh


def _job(launcher, run_dir: Path, *overrides, step_seconds=0.0, **env) -> Job:
    args = [*ARGS, f"config.CHECKPOINT.DIR={run_dir}", *overrides]
    return ForkedJob(launcher, JOB, args, run_dir, job_env(STOP_JOB_STEP_SECONDS=str(step_seconds), **env))


def _train(rank, world_size, argv):
    from vistrain.methods import load_config
    from vistrain.training import train

    train(load_config(argv))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The losses of the uninterrupted run: 2 ranks (forked, so faster to start than the launcher's,
    and the same numbers: same seed, one thread each)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    argv = ["config=test/simclr_tiny", "config.LOG_FREQUENCY=1", *ARGS, f"config.CHECKPOINT.DIR={run_dir}"]
    run_on_ranks(_train, 2, argv)
    logged = losses(run_dir)
    assert sorted(logged) == list(range(1, ITERATIONS + 1))
    return logged


def _assert_same_losses(run_dir: Path, reference: dict, until: int = ITERATIONS) -> None:
    got = losses(run_dir)
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
    stopped = last_iteration(run_dir)  # LOG_FREQUENCY 1: the stop iteration was logged first
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


def test_stop_signals_to_the_launcher_to_one_rank_and_to_every_process_lose_nothing(
    tmp_path, reference, launcher
):
    """One run folder, stopped three times: SIGTERM to the launcher only; SIGTERM to rank 1 only;
    SIGUSR1 to every process of the job at once, DataLoader workers included (as SLURM's --signal
    does). Every rerun resumes
    where the last one stopped, and the losses equal the uninterrupted run's."""
    run_dir, stops = tmp_path / "run", []
    targets = [
        ("SIGTERM", lambda job: os.kill(job.proc.pid, signal.SIGTERM), []),
        ("SIGTERM", lambda job: os.kill(job.pid(1), signal.SIGTERM), []),
        # DataLoader workers get it too (and leave it to their rank); they change no number
        (
            "SIGUSR1",
            lambda job: os.killpg(job.proc.pid, signal.SIGUSR1),
            ["config.DATA.NUM_DATALOADER_WORKERS=1"],
        ),
    ]
    for sig, send, overrides in targets:
        job = _job(launcher, run_dir, *overrides, step_seconds=0.3)
        job.wait_for_iteration((stops[-1] if stops else 0) + 1)
        sent = time.monotonic()
        send(job)
        stops.append(_assert_stopped_at_a_boundary(run_dir, *job.finish(since=sent), sig))
        # nothing of the job lingers (DataLoader workers die with their rank) to print after its
        # line (the resource tracker's "leaked semaphore objects" warning)
        assert not job.outlived_by(3.0)
        assert len(job.err.read_text().splitlines()) == 1, job.err.read_text()
    assert stops == sorted(stops) and stops[-1] < ITERATIONS
    log = (run_dir / "log.txt").read_text()
    for stopped in stops[:-1]:
        assert f"resumed from {run_dir / f'checkpoint_{stopped}'} at iteration {stopped}" in log
    _assert_same_losses(run_dir, reference, until=stops[-1])


def test_a_step_that_cannot_finish_within_the_grace_is_abandoned(tmp_path, launcher):
    """Rank 0 hangs in the 4th step; SIGTERM to the launcher: exit 143 within the grace (3 s here),
    one line, and checkpoint_2 (saved before) stays the latest: nothing partial replaced it."""
    run_dir = tmp_path / "run"
    job = _job(
        launcher,
        run_dir,
        "config.CHECKPOINT.STOP_GRACE_SECONDS=3",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
        STOP_JOB_HANG_AT="3",
    )
    job.wait_until_hanging()
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


def _srun_job(tmp_path: Path, run_dir: Path, *overrides, **env) -> Job:
    srun = ["srun", "--kill-on-bad-exit=1", sys.executable, JOB, *ARGS, f"config.CHECKPOINT.DIR={run_dir}"]
    return Job(["bash", "-c", shlex.join([*srun, *overrides])], run_dir, slurm_env(tmp_path, **env))


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
    stopped = last_iteration(run_dir)
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
    job.wait_until_hanging()
    sent = time.monotonic()
    for rank in (0, 1):  # scancel: every task of the job step
        os.kill(job.pid(rank), signal.SIGTERM)
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
    job = Job(command, run_dir, job_env(STOP_JOB_STEP_SECONDS="0.2"))
    job.wait_for_iteration(3)
    os.kill(job.pid(1), signal.SIGTERM)
    code, err, _ = job.finish()
    assert code == 0, err
    log = (run_dir / "log.txt").read_text()
    assert "resumed from" in log
    _assert_same_losses(run_dir, reference)


# --------------------------------------------------------------------------------------------
# the pieces, in one process


def test_the_stop_line_says_how_to_resume(tmp_path):
    """With AUTO_RESUME off the same command would start afresh: the line names the key."""
    import json

    from vistrain.checkpoint.files import FORMAT
    from vistrain.cli import stop_line
    from vistrain.methods import load_config

    checkpoint = tmp_path / "checkpoint_4"
    checkpoint.mkdir()
    torch.save({"w": torch.zeros(1)}, checkpoint / "rank0.pt")
    meta = {"format": FORMAT, "iteration": 4, "samples_seen": 32, "rank_files": ["rank0.pt"]}
    (checkpoint / "metadata.json").write_text(json.dumps(meta))
    cfg = load_config(["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={tmp_path}"])
    assert stop_line(cfg, "SIGTERM at iteration 4") == (
        f"stopped: SIGTERM at iteration 4; rerun the same command to resume from {checkpoint}"
    )
    cfg = load_config(
        [
            "config=test/simclr_tiny",
            f"config.CHECKPOINT.DIR={tmp_path}",
            "config.CHECKPOINT.AUTO_RESUME=False",
        ]
    )
    assert stop_line(cfg, "SIGTERM at iteration 4") == (
        f"stopped: SIGTERM at iteration 4; rerun with config.CHECKPOINT.AUTO_RESUME=True to resume from {checkpoint}"
    )


def test_a_stop_signal_outside_a_loop_raises_and_inside_one_is_only_recorded():
    from vistrain.config import StopRequested
    from vistrain.distributed.stop_signals import StopSignals

    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals(grace_seconds=60) as stop:
        assert StopSignals.installed() is stop
        with pytest.raises(StopRequested, match="^SIGUSR1: every rank stopped$"):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)  # the handler runs at the next bytecode
    assert signal.getsignal(signal.SIGTERM) is previous and StopSignals.installed() is None
    with StopSignals(grace_seconds=60) as stop:
        stop.defer()  # a loop that stops at its boundaries
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous  # its grace timer was cancelled too


def test_the_launcher_tells_a_stop_from_a_failure_by_how_its_ranks_ended():
    from types import SimpleNamespace

    from vistrain.distributed.spawn import _stopped_by_signal

    def ranks(*codes):
        return [SimpleNamespace(exitcode=code) for code in codes]

    assert _stopped_by_signal(ranks(1, -signal.SIGKILL), None) is None  # a crash: not a stop
    assert _stopped_by_signal(ranks(-signal.SIGTERM, 0), None) == "SIGTERM: every rank stopped"
    assert _stopped_by_signal(ranks(-signal.SIGUSR1, 1), signal.SIGUSR1) == "SIGUSR1: every rank stopped"
    abandoned = "SIGTERM: the step in progress did not end within the grace and was abandoned"
    assert _stopped_by_signal(ranks(143, 1), signal.SIGTERM) == abandoned
    assert _stopped_by_signal(ranks(-signal.SIGKILL, -signal.SIGKILL), signal.SIGTERM) == abandoned


def test_job_rank_reads_torchrun_and_srun_variables():
    from vistrain.config.job_env import job_rank

    assert job_rank({}) == 0
    assert job_rank({"RANK": "3", "WORLD_SIZE": "4"}) == 3
    assert job_rank({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}) == 2
    assert job_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == 0  # one task spawns its own ranks


def test_a_stop_signal_swallowed_by_library_code_before_the_start_still_stops():
    """The pre-start handler raises where the signal lands; code that catches every exception
    there (torch's import has such blocks) must not make the job run on as if nothing came."""
    from vistrain import cli
    from vistrain.config import StopRequested

    before = signal.getsignal(signal.SIGTERM)
    swallowing = pytest.raises(StopRequested, match="SIGTERM before the run started")
    with swallowing, cli._stop_signals_before_start():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs here, at the latest
        except Exception:  # what the library code does with it
            pass
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_a_stop_signal_while_the_job_starts_is_one_line(tmp_path):
    """SIGTERM as soon as the command says what it does (checking, planning, starting the ranks):
    whatever it was doing, one line and exit 143."""
    run_dir = tmp_path / "run"
    job = Job(
        [
            sys.executable,
            str(REPO / "tools" / "run_distributed.py"),
            "config=test/simclr_tiny",
            # the whole tiny job takes about a second with forked ranks: a test process that a
            # loaded machine holds back longer would signal a job that already ended (exit 0)
            "config.OPTIMIZER.num_epochs=1000",
            f"config.CHECKPOINT.DIR={run_dir}",
        ],
        run_dir,
        job_env(),
    )
    deadline = time.monotonic() + 120
    while not job.out.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(job.proc.pid, signal.SIGTERM)
    code, err, _ = job.finish()
    assert code == 143 and len(err) == 1 and err[0].startswith("stopped: SIGTERM"), err


_SIGNAL_WHILE_LAUNCHING = """
import os, signal, sys, time
from vistrain import cli
from vistrain.methods import load_config
from vistrain.distributed import launch

def launch_hit_by_sigterm(job, cfg, announce=None, may_fork=False):  # before the launcher installs its handlers
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)

launch.launch = launch_hit_by_sigterm
sys.exit(cli.run(print, load_config(["config=test/simclr_tiny", "config.CHECKPOINT.DIR=" + sys.argv[1]])))
"""


def test_a_stop_signal_before_the_launcher_handles_it_is_one_line(tmp_path):
    """Between the checks and the launcher's own handlers a SIGTERM ended the command silently."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WHILE_LAUNCHING, str(tmp_path / "run")],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 143 and done.stderr.splitlines() == [
        f"stopped: SIGTERM before the run started; nothing was written; no checkpoint in {tmp_path / 'run'} yet"
    ]


# --------------------------------------------------------------------------------------------
# leaving a DataLoader pass unfinished


def test_a_process_that_leaves_its_loaders_passes_unfinished_exits_at_once(tmp_path, launcher):
    """The DataLoader workers ignore SIGTERM (it is the rank's); a process leaving a pass unfinished
    (a break, an exception; in a multiprocessing child, as a spawned rank, too) with the workers
    alive at exit still exits at once, instead of waiting forever in multiprocessing's exit
    handler for workers that ignore its SIGTERM."""
    out, err = tmp_path / "out", tmp_path / "err"
    launcher.start([str(tmp_path / "left")], out, err, script=str(REPO / "tests" / "abandon_loader_job.py"))
    code = launcher.wait(timeout=150)  # about 2 s of CPU, more on a busy machine; a hang is forever
    assert (tmp_path / "left").read_text() == "child 0\nleft\n"
    assert code == 1 and "RuntimeError: abandoned mid-epoch" in err.read_text(), err.read_text()
