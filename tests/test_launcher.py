"""Launcher: rank/rendezvous planning, and a failing or SIGKILLed rank ending the whole job quickly.

The failure tests start this file as a script (``python tests/test_launcher.py MODE DIR``) so that
the exit code of a real launcher process is checked; the spawned ranks import this module.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vistrain.config import ConfigError, load_config
from vistrain.distributed.launch import RankFailedError, first_slurm_host, launch, plan_launch

HERE = Path(__file__).resolve()


def _cfg(*overrides):
    return load_config(["config.MACHINE.DEVICE=cpu", *overrides])


def _plan(*overrides, environ=None):
    cfg = _cfg(*overrides)
    return plan_launch(cfg.DISTRIBUTED, cfg.MACHINE, environ or {})


# --------------------------------------------------------------------------------------------
# planning (pure)


def test_single_node_spawn_plan_picks_a_free_local_port():
    plan = _plan("config.DISTRIBUTED.NUM_PROC_PER_NODE=3")
    assert plan.spawn and (plan.world_size, plan.first_rank, plan.local_ranks) == (3, 0, 3)
    assert plan.backend == "gloo" and plan.device == "cpu"
    assert plan.init_method.startswith("tcp://127.0.0.1:") and int(plan.init_method.rsplit(":", 1)[1]) > 0


def test_multi_node_plan_uses_node_id_and_run_id():
    plan = _plan(
        "config.DISTRIBUTED.NUM_NODES=3",
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=4",
        "config.DISTRIBUTED.NODE_ID=2",
        "config.DISTRIBUTED.RUN_ID=node0.cluster:29501",
    )
    assert (plan.world_size, plan.first_rank, plan.local_ranks) == (12, 8, 4)
    assert plan.init_method == "tcp://node0.cluster:29501"


def test_file_and_env_init_methods():
    plan = _plan("config.DISTRIBUTED.INIT_METHOD=file", "config.DISTRIBUTED.RUN_ID=/shared/run1")
    assert plan.init_method == "file:///shared/run1"
    env = {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "1234"}
    assert _plan("config.DISTRIBUTED.INIT_METHOD=env", environ=env).init_method == "env://"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["config.DISTRIBUTED.NUM_NODES=2"], "multi-node run needs DISTRIBUTED.RUN_ID"),
        (["config.DISTRIBUTED.NODE_ID=1"], "NODE_ID must be in [0, 1)"),
        (["config.DISTRIBUTED.NUM_PROC_PER_NODE=0"], "must be >= 1"),
        (["config.DISTRIBUTED.BACKEND=nccl"], "BACKEND=nccl needs CUDA"),
        (["config.DISTRIBUTED.BACKEND=mpi"], "BACKEND must be auto, nccl or gloo"),
        (["config.DISTRIBUTED.INIT_METHOD=udp"], "INIT_METHOD must be tcp, env or file"),
        (["config.DISTRIBUTED.RUN_ID=localhost"], "RUN_ID must be host:port"),
        (["config.DISTRIBUTED.TIMEOUT_SECONDS=0"], "TIMEOUT_SECONDS must be > 0"),
        (["config.MACHINE.DEVICE=tpu"], "MACHINE.DEVICE must be auto, cpu or cuda"),
    ],
)
def test_impossible_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        _plan(*overrides)
    assert message in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu():
    with pytest.raises(ConfigError, match="no CUDA device"):
        _plan("config.MACHINE.DEVICE=cuda")


def test_joins_torchrun_environment_without_spawning():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    plan = _plan(environ=env)
    assert not plan.spawn
    assert (plan.world_size, plan.first_rank, plan.local_rank, plan.init_method) == (8, 5, 1, "env://")


def test_joins_slurm_tasks():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_JOB_ID": "12345",
    }
    plan = _plan("config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", environ=env)
    assert not plan.spawn
    assert (plan.world_size, plan.first_rank, plan.local_rank) == (4, 3, 1)
    assert plan.init_method == f"tcp://gpu007:{20000 + 12345 % 20000}"
    with pytest.raises(ConfigError, match="SLURM started 4 tasks but DISTRIBUTED asks for 1 ranks"):
        _plan(environ=env)


def test_single_slurm_task_spawns_its_local_ranks():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}
    assert _plan("config.DISTRIBUTED.NUM_PROC_PER_NODE=2", environ=env).spawn


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("n1", "n1"),
        ("n1,n2", "n1"),
        ("gpu[003-005,9],cpu1", "gpu003"),
        ("a[1,2],b[3]", "a1"),
        ("x-y[10]", "x-y10"),
    ],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


# --------------------------------------------------------------------------------------------
# real processes


def _single_rank_reports(cfg):
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == 1  # a group even for one process
    Path(cfg.CHECKPOINT.DIR, "ran").write_text(dist.get_backend())


def test_single_process_gets_a_process_group(tmp_path):
    launch(_single_rank_reports, _cfg(f"config.CHECKPOINT.DIR={tmp_path}"))
    assert (tmp_path / "ran").read_text() == "gloo"


def _raise_on_rank1(cfg):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one broke on purpose")
    _collectives_forever(cfg)


def _wait_to_be_killed(cfg):
    _collectives_forever(cfg)


def _collectives_forever(cfg):
    """Write this rank's pid, then all-reduce in a loop (a healthy job would run for 5 minutes)."""
    import torch.distributed as dist

    Path(cfg.CHECKPOINT.DIR, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    for _ in range(3000):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)


def _run_script(mode: str, run_dir: Path):
    return subprocess.Popen(
        [sys.executable, str(HERE), mode, str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_raising_rank_stops_the_job_with_its_traceback(tmp_path):
    start = time.monotonic()
    proc = _run_script("raise", tmp_path)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1
    assert "rank 1 failed" in err and "ValueError: rank one broke on purpose" in err
    assert time.monotonic() - start < 120  # mostly interpreter start-up; a hang would take 300 s


def test_a_sigkilled_rank_stops_the_job_within_a_minute(tmp_path):
    proc = _run_script("kill", tmp_path)
    pid_file = tmp_path / "pid1"
    deadline = time.monotonic() + 150
    while not (pid_file.exists() and (tmp_path / "pid0").exists()):
        assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    time.sleep(0.5)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=90)
    assert time.monotonic() - killed_at < 60
    assert proc.returncode == 1
    assert "rank 1 was killed by signal SIGKILL" in err
    rank0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(rank0, 0)  # the surviving rank was stopped too


if __name__ == "__main__":
    # python tests/test_launcher.py raise|kill RUN_DIR: a 2-rank CPU job, exit code like the CLI's
    mode, run_dir = sys.argv[1], sys.argv[2]
    job = _cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=2", f"config.CHECKPOINT.DIR={run_dir}")
    try:
        launch({"raise": _raise_on_rank1, "kill": _wait_to_be_killed}[mode], job)
    except RankFailedError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
