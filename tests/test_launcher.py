"""Launcher: rank/rendezvous planning, and a failing or SIGKILLed rank ending the whole job quickly.

The failure tests start this file as a script (``python tests/test_launcher.py MODE DIR``) so that
the exit code of a real launcher process is checked; the spawned ranks import this module.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vistrain import cli
from vistrain.config import ConfigError, DataError
from vistrain.distributed.join import attempt_store, slurm_tasks_on_node
from vistrain.distributed.launch import first_slurm_host, launch, plan_launch
from vistrain.distributed.network import check_gloo_interface
from vistrain.methods import load_config

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


def test_gloo_across_machines_whose_host_name_is_loopback_needs_the_interface(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # as many /etc/hosts say
    two_nodes = ["config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.RUN_ID=198.18.0.1:29500"]
    with pytest.raises(ConfigError, match="set GLOO_SOCKET_IFNAME to the interface that reaches 198.18.0.1"):
        check_gloo_interface("gloo", True, _plan(*two_nodes).init_method, {})
    joined = {"MASTER_ADDR": "10.1.1.1"}  # torchrun / srun
    with pytest.raises(ConfigError, match="reaches 10.1.1.1"):
        check_gloo_interface("gloo", True, "env://", joined)
    check_gloo_interface("gloo", True, "env://", {**joined, "GLOO_SOCKET_IFNAME": "eth0"})  # set: fine
    check_gloo_interface("gloo", True, "tcp://127.0.0.1:29500", {})  # one machine's "nodes" (tests)
    check_gloo_interface("gloo", False, "tcp://198.18.0.1:29500", {})  # one node
    check_gloo_interface("nccl", True, "tcp://198.18.0.1:29500", {})
    # through the command line: one line, exit 2, before anything starts
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    argv = ["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={tmp_path / 'run'}", *two_nodes]
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("config error: this machine's host name") and not (tmp_path / "run").exists()


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
    plan = _plan(environ={**env, "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"})
    assert not plan.spawn and plan.local_ranks == 1
    # the process runs as rank first_rank + 0: its global rank, never global + local (issue 15)
    assert (plan.world_size, plan.first_rank, plan.local_rank, plan.init_method) == (8, 5, 1, "env://")
    assert plan.ranks_per_node == 4 and plan.device_index == 0  # CPU: no device to pick
    assert plan.elastic_attempt is None  # not started by an elastic agent: plain env://
    assert _plan(environ={**env, "TORCHELASTIC_RESTART_COUNT": "1"}).elastic_attempt == 1


def test_torchrun_decides_the_layout_and_names_the_keys_it_overrides():
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    env.update(LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="2")
    (note,) = _plan(
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=8", "config.DISTRIBUTED.RUN_ID=n0:1234", environ=env
    ).notes
    assert note == (
        "torchrun decides the layout (2 nodes, 2 ranks on this node, world size 4, rendezvous env://); "
        "ignoring DISTRIBUTED.NUM_NODES=1, NUM_PROC_PER_NODE=8, RUN_ID=n0:1234"
    )
    agreeing = _plan("config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", environ=env)
    assert agreeing.notes == ()


def test_each_torchrun_restart_attempt_sees_only_its_own_rendezvous_keys():
    """torchrun's agent keeps one store across restarts; a new attempt must not read the dead group's keys."""
    import datetime

    import torch.distributed as dist

    from vistrain.distributed.launch import find_free_port

    timeout = datetime.timedelta(seconds=30)
    agent = dist.TCPStore("127.0.0.1", find_free_port(), is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    dead = attempt_store(env, rank=0, attempt=0, timeout=timeout)  # rank 0 is a client of the agent
    dead.set("rank0/address", "old")
    new = attempt_store(env, rank=0, attempt=1, timeout=timeout)
    assert not new.check(["rank0/address"])
    new.set("rank0/address", "new")
    assert dead.get("rank0/address") == b"old" and new.get("rank0/address") == b"new"
    # without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) rank 0 hosts it, as env:// does
    own = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    host = attempt_store(own, rank=0, attempt=2, timeout=timeout)
    host.set("k", "v")
    assert attempt_store(own, rank=1, attempt=2, timeout=timeout).get("k") == b"v"


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"RANK": "1", "WORLD_SIZE": "2"},
            "incomplete torchrun environment: MASTER_ADDR, MASTER_PORT not set",
        ),
        (
            {"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "RANK='x' is not an integer",
        ),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "reports rank 2 of 2"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2x"}, "cannot read SLURM_TASKS"),
    ],
)
def test_broken_job_environments_are_config_errors(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _plan(environ=env)


def _slurm_env(procid, localid, ntasks=4, nodeid=0, tasks_per_node="2(x2)", nodes=2):
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_NODEID": str(nodeid),
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_JOB_ID": "12345",
    }


def test_joins_slurm_tasks():
    plan = _plan(
        "config.DISTRIBUTED.NUM_NODES=2",
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
        environ=_slurm_env(procid=3, localid=1, nodeid=1),
    )
    assert not plan.spawn and plan.notes == ()
    assert (plan.world_size, plan.first_rank, plan.local_rank, plan.ranks_per_node) == (4, 3, 1, 2)
    assert plan.init_method == f"tcp://gpu007:{20000 + 12345 % 20000}"
    # a recipe written for one node: srun's layout wins, with a note
    (note,) = _plan(environ=_slurm_env(procid=3, localid=1, nodeid=1)).notes
    assert note.startswith("srun decides the layout (2 nodes, 2 ranks on this node, world size 4")
    assert note.endswith("ignoring DISTRIBUTED.NUM_NODES=1, NUM_PROC_PER_NODE=1")


def test_slurm_rendezvous_can_be_chosen_by_the_config():
    env = _slurm_env(procid=0, localid=0)
    assert _plan("config.DISTRIBUTED.RUN_ID=n9:777", environ=env).init_method == "tcp://n9:777"
    file_plan = _plan(
        "config.DISTRIBUTED.INIT_METHOD=file", "config.DISTRIBUTED.RUN_ID=/shared/x", environ=env
    )
    assert file_plan.init_method == "file:///shared/x"
    exported = {**env, "MASTER_ADDR": "n3", "MASTER_PORT": "5"}
    assert _plan("config.DISTRIBUTED.INIT_METHOD=env", environ=exported).init_method == "env://"
    with pytest.raises(ConfigError, match="INIT_METHOD=env under srun needs MASTER_ADDR"):
        _plan("config.DISTRIBUTED.INIT_METHOD=env", environ=env)


@pytest.mark.parametrize(
    "tasks_per_node, counts",
    [("8", [8]), ("2(x3),1", [2, 2, 2, 1]), ("4,3(x2)", [4, 3, 3])],
)
def test_slurm_tasks_on_node(tasks_per_node, counts):
    assert [slurm_tasks_on_node(tasks_per_node, node) for node in range(len(counts))] == counts
    with pytest.raises(ConfigError, match="lists no node"):
        slurm_tasks_on_node(tasks_per_node, len(counts))


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


def _bad_input_on_rank1(cfg):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise DataError("rank one found the data wrong; set DATA.TRAIN.SKIP_CORRUPT=True")
    _collectives_forever(cfg)


def _wait_to_be_killed(cfg):
    _collectives_forever(cfg)


MODES = {"raise": _raise_on_rank1, "input": _bad_input_on_rank1, "kill": _wait_to_be_killed}


def _collectives_forever(cfg):
    """Write this rank's pid, then all-reduce until stopped (only the launcher ends this job);
    ``ready<rank>`` once the first all-reduce is done: every rank is in the loop."""
    import torch.distributed as dist

    Path(cfg.CHECKPOINT.DIR, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    dist.all_reduce(torch.ones(1))
    Path(cfg.CHECKPOINT.DIR, f"ready{dist.get_rank()}").touch()
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)


def _run_script(mode: str, run_dir: Path):
    return subprocess.Popen(
        [sys.executable, str(HERE), mode, str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# A healthy job of these modes never ends: a launcher that did not stop it would hang until this.
HANG = 600


def _assert_stopped(run_dir: Path, rank: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(int((run_dir / f"pid{rank}").read_text()), 0)


def test_a_raising_rank_stops_the_job_with_its_traceback(tmp_path):
    proc = _run_script("raise", tmp_path)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 1
    assert err.startswith("run failed: rank 1 failed:\nTraceback")
    assert err.rstrip().endswith("ValueError: rank one broke on purpose")
    _assert_stopped(tmp_path, 0)


def test_a_rank_finding_bad_input_stops_the_job_in_one_line(tmp_path):
    proc = _run_script("input", tmp_path)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 2
    assert err.splitlines() == ["data error: rank one found the data wrong; set DATA.TRAIN.SKIP_CORRUPT=True"]
    _assert_stopped(tmp_path, 0)


def test_a_sigkilled_rank_stops_the_job(tmp_path):
    proc = _run_script("kill", tmp_path)
    while not ((tmp_path / "ready0").exists() and (tmp_path / "ready1").exists()):
        assert proc.poll() is None, "ranks did not start"
        time.sleep(0.1)
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 1
    assert "rank 1 was killed by signal SIGKILL" in err
    _assert_stopped(tmp_path, 0)  # the surviving rank was stopped too


_START_METHODS = """
import dataclasses, torch
from vistrain.distributed.rank import LaunchPlan
from vistrain.distributed.spawn import _start_method
plan = LaunchPlan(2, 0, 2, 0, "tcp://127.0.0.1:1", "gloo", "cpu", 60, True, ranks_per_node=2)
cuda = dataclasses.replace(plan, device="cuda", backend="nccl")
print(_start_method(plan, True), _start_method(plan, False), _start_method(cuda, True))
torch.set_num_threads(2)
torch.ones(256, 256) @ torch.ones(256, 256)  # OpenMP's pool starts: forking is unsafe from here on
print(_start_method(plan, True))
"""


def test_cpu_ranks_are_forked_only_from_a_launcher_that_has_computed_nothing():
    out = subprocess.run([sys.executable, "-c", _START_METHODS], capture_output=True, text=True, check=True)
    if not sys.platform.startswith("linux"):
        pytest.skip("ranks are always spawned off Linux")
    assert out.stdout.split() == ["fork", "spawn", "spawn", "spawn"]


if __name__ == "__main__":
    # python tests/test_launcher.py raise|input|kill RUN_DIR: a 2-rank CPU job through the command
    # line's launcher (its exit codes and messages)
    mode, run_dir = sys.argv[1], sys.argv[2]
    job = _cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=2", f"config.CHECKPOINT.DIR={run_dir}")
    sys.exit(cli.run(MODES[mode], job))


def _fail_in_rank(cfg):
    raise RuntimeError("the rank's own failure")


def _world_size_in_rank(cfg):
    return torch.distributed.get_world_size()


def test_a_failed_in_process_rank_leaves_no_process_group_and_its_local_rank_unset(tmp_path, monkeypatch):
    """One rank runs in the caller's process: after it fails, a second run in the same process
    starts (no 'default process group already initialised'), and a later fork inherits no group."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = _cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=1", f"config.CHECKPOINT.DIR={tmp_path / 'run'}")
    with pytest.raises(RuntimeError, match="the rank's own failure"):
        launch(_fail_in_rank, cfg)
    assert not torch.distributed.is_initialized() and "LOCAL_RANK" not in os.environ
    launch(_world_size_in_rank, cfg)
    assert not torch.distributed.is_initialized() and "LOCAL_RANK" not in os.environ


def test_free_ports_are_drawn_below_the_ephemeral_range_whatever_the_seed():
    """A port the kernel hands out to others (gloo's connections) is never the rendezvous's."""
    import random

    from vistrain.distributed.launch import PORT_RANGE_START, _ephemeral_low, find_free_port

    if _ephemeral_low() - PORT_RANGE_START < 1000:
        pytest.skip(f"this kernel's ephemeral ports start at {_ephemeral_low()}: no room below them")
    ports = set()
    for _ in range(5):
        random.seed(0)  # training seeds Python's random: the draw must not follow it
        port = find_free_port()
        assert PORT_RANGE_START <= port < _ephemeral_low()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))
        ports.add(port)
    assert len(ports) > 1
