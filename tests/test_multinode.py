"""Jobs started by torchrun, srun and the launcher's own multi-node mode, end to end on this machine.

Every test starts the real thing (``python -m torch.distributed.run``; ``tools/slurm/train.sbatch``
whose srun, played by a script, starts tasks with srun's variables; two launcher "nodes" on 127.0.0.1), trains the tiny SimCLR recipe for a few
iterations and compares its losses (``metrics.jsonl``) with the same world size on one node
(one reference run per world size, shared by the module, on ranks forked from pytest). Same world size, same
seeds, one thread per rank: the losses must agree to float rounding.

The elastic test starts this file under torchrun (``python tests/test_multinode.py KILL_AT MARKER
ARGS...``): rank 1 SIGKILLs itself once before the optimizer step of iteration KILL_AT.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vistrain.distributed.launch import find_free_port
from vistrain.distributed.testing import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
RUN = str(REPO / "tools" / "run_distributed.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# 32 images, 2 epochs; a checkpoint every 2 iterations so that the elastic restart resumes mid-epoch
TINY = [
    "config=test/simclr_tiny",
    "config.LOG_FREQUENCY=1",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
    "config.CHECKPOINT.KEEP_LAST=10",
]
# a shard group per "node" (hybrid sharding): the 4-rank jobs below cross nodes with it
HYBRID = ("config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.MODEL.FSDP_CONFIG.shard_group_size=2")
TIMEOUT = 240  # per job; a hung rendezvous fails the test instead of the suite
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _env(**extra) -> dict:
    """This checkout first on the path, one thread per rank, no job variables inherited from outside."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def _args(run_dir, *overrides):
    return [*TINY, f"config.CHECKPOINT.DIR={run_dir}", *overrides]


def _run_together(commands, run_dir: Path, envs=None):
    """Start every command at once (the "nodes" of one job), wait for all; fail with their output."""
    envs = envs or [_env()] * len(commands)
    logs = [run_dir.parent / f"{run_dir.name}.out{i}" for i in range(len(commands))]
    procs = []
    for command, env, log in zip(commands, envs, logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [log.read_text() for log in logs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return outputs


def _losses(run_dir) -> dict:
    """iteration -> loss; after a restart the re-done iterations' latest record counts."""
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records}


def _free_port_between(low: int, high: int) -> int:
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:  # nobody listens there
                return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def _train(rank, world_size, argv):
    from vistrain.methods import load_config
    from vistrain.training import train

    train(load_config(argv))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(world size, overrides) -> losses of the same run on one node (each computed once per
    module), on ranks forked from this process: the jobs under test start the real launchers, the
    reference needs only the numbers (same seeds, one thread per rank), not half a minute of
    launcher start-up."""
    cache = {}

    def losses(world: int, *overrides) -> dict:
        if (world, overrides) not in cache:
            run_dir = tmp_path_factory.mktemp("reference") / f"world{world}"
            layout = f"config.DISTRIBUTED.NUM_PROC_PER_NODE={world}"
            run_on_ranks(_train, world, _args(run_dir, layout, *overrides))
            cache[world, overrides] = _losses(run_dir)
        return cache[world, overrides]

    return losses


def _assert_same_losses(run_dir, reference: dict, iterations: int):
    got = _losses(run_dir)
    assert sorted(got) == sorted(reference) == list(range(1, iterations + 1))
    torch.testing.assert_close(
        torch.tensor([got[i] for i in sorted(got)], dtype=torch.float64),
        torch.tensor([reference[i] for i in sorted(reference)], dtype=torch.float64),
        rtol=1e-6,
        atol=1e-7,
    )


def _assert_rank0_side_effects(run_dir: Path, iterations: int):
    """config.yaml, TensorBoard and one metrics line per iteration: written by global rank 0 alone."""
    assert (run_dir / "config.yaml").is_file() and (run_dir / "log.txt").is_file()
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == iterations


# --------------------------------------------------------------------------------------------
# torchrun


def test_two_torchrun_nodes_with_c10d_rendezvous(tmp_path, reference):
    """Two agents (nodes) of 2 workers each meet in a c10d rendezvous on 127.0.0.1: world size 4,
    a shard group per node."""
    run_dir, port = tmp_path / "run", find_free_port()
    commands = [
        [
            *TORCHRUN,
            "--nnodes=2",
            "--nproc_per_node=2",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=vistrain_test",
            f"--rdzv_conf=is_host={int(node == 0)}",  # who serves the store: no race between the two
            "--local_addr=127.0.0.1",
            RUN,
            *_args(run_dir, *HYBRID),
        ]
        for node in range(2)
    ]
    outputs = _run_together(commands, run_dir)
    _assert_same_losses(run_dir, reference(4, *HYBRID), iterations=4)
    _assert_rank0_side_effects(run_dir, iterations=4)
    # the recipe's NUM_PROC_PER_NODE: 2 is right per node, NUM_NODES: 1 is not: one note, once
    notes = [line for out in outputs for line in out.splitlines() if "ignoring DISTRIBUTED." in line]
    assert len(notes) == 1 and "torchrun decides the layout (2 nodes, 2 ranks" in notes[0]


def _die_once_before_step(kill_at: int, marker: Path):
    """Patch the trainer: rank 1 SIGKILLs itself before the step of iteration ``kill_at``, once per marker."""
    from vistrain.distributed import comm
    from vistrain.training import trainer

    step = trainer._optimizer_step

    def step_or_die(model, criterion, optimizer, settings, iteration):
        if iteration == kill_at and comm.get_rank() == 1 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        step(model, criterion, optimizer, settings, iteration)

    trainer._optimizer_step = step_or_die


def test_torchrun_standalone_restarts_a_killed_worker_and_resumes_exactly(tmp_path, reference):
    """torchrun --standalone, 2 workers: rank 1 dies mid-epoch 0 (after checkpoint_2); torchrun
    restarts both, they resume from iteration 2 and end with the losses of the uninterrupted run;
    global rank 0 alone writes the run's files in each attempt."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    script = [str(Path(__file__).resolve()), "3", str(marker)]
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", *script, *_args(run_dir)]
    (output,) = _run_together([command], run_dir)
    assert marker.exists(), "the worker was never killed"
    assert output.count("training 2 epochs x 4 iterations on 2 ranks") == 2  # once per attempt
    assert "resumed from" in output and "checkpoint_2" in output
    records = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records == [1, 2, 3, 3, 4, 5, 6, 7, 8]  # iteration 3 logged, killed before step 4, re-done
    _assert_same_losses(run_dir, reference(2), iterations=8)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "log.txt").is_file()
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 2  # one per attempt


# --------------------------------------------------------------------------------------------
# srun and the launcher's own multi-node mode


FAKE_SRUN = """#!/bin/bash
# stand-in for srun on one node: start SLURM_NTASKS copies of the command with srun's task variables
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


def test_sbatch_script_with_two_srun_tasks_on_one_node(tmp_path, reference):
    """tools/slurm/train.sbatch as SLURM runs it for `--nodes 1 --ntasks-per-node 2`, srun played by a script.

    The tasks see the variables srun sets; they meet at the job's first node on port 20000 + job id.
    """
    run_dir, bin_dir = tmp_path / "run", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    # the sbatch script's `python` is this interpreter, started by its own path: a link to it elsewhere
    # would not find a virtualenv's pyvenv.cfg and would run without the venv's packages
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    job_id = _free_port_between(21000, 40000) - 20000
    env = _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_CPUS_PER_TASK="1",
        SLURM_NTASKS="2",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_JOB_ID=str(job_id),
    )
    sbatch = ["bash", str(REPO / "tools" / "slurm" / "train.sbatch"), *_args(run_dir)]
    (output,) = _run_together([sbatch], run_dir, [env])
    _assert_same_losses(run_dir, reference(2), iterations=8)
    _assert_rank0_side_effects(run_dir, iterations=8)
    assert "ignoring" not in output  # the recipe's 1 node x 2 ranks is the job's layout


def test_launcher_two_nodes_of_two_ranks(tmp_path, reference):
    """The launcher's own multi-node mode, a shard group per node."""
    run_dir, port = tmp_path / "run", find_free_port()
    commands = [
        [
            sys.executable,
            RUN,
            *_args(run_dir, *HYBRID),
            "config.DISTRIBUTED.NUM_NODES=2",
            f"config.DISTRIBUTED.NODE_ID={node}",
            f"config.DISTRIBUTED.RUN_ID=127.0.0.1:{port}",
        ]
        for node in range(2)
    ]
    _run_together(commands, run_dir)
    _assert_same_losses(run_dir, reference(4, *HYBRID), iterations=4)
    _assert_rank0_side_effects(run_dir, iterations=4)


def test_a_shard_group_per_node_equals_ddp_on_one_node(reference):
    """The hybrid reference the 4-rank jobs above match is itself DDP's run (other sums: close)."""
    hybrid, ddp = reference(4, *HYBRID), reference(4)
    assert sorted(hybrid) == sorted(ddp) == [1, 2, 3, 4]
    torch.testing.assert_close(
        torch.tensor([hybrid[i] for i in sorted(hybrid)], dtype=torch.float64),
        torch.tensor([ddp[i] for i in sorted(ddp)], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )


# --------------------------------------------------------------------------------------------
# per-node and rank-0-only side effects (gloo processes, no training)


def _prepare_demo_as_two_nodes(rank, world_size, tmp):
    """Ranks 0,1 are node 0 and ranks 2,3 node 1; record which ranks write the demo set."""
    import vistrain.data.demo_digits as demo

    os.environ["LOCAL_RANK"] = str(rank % 2)
    write = demo.write_demo_digits
    phase = ["node-local"]

    def recording_write(folder):
        Path(tmp, f"{phase[0]}-written-by-{rank}").touch()
        return write(folder)

    demo.write_demo_digits = recording_write
    roots = [demo.ensure_demo_digits_on_every_node(str(Path(tmp, f"node{rank // 2}")))]
    phase[0] = "shared"
    roots.append(demo.ensure_demo_digits_on_every_node(str(Path(tmp, "shared"))))
    return [os.path.isfile(os.path.join(root, "META.json")) for root in roots]


def test_demo_data_is_written_by_local_rank_0_of_each_node(tmp_path):
    assert run_on_ranks(_prepare_demo_as_two_nodes, 4, str(tmp_path)) == [[True, True]] * 4
    writers = lambda phase: sorted(p.name.rsplit("-", 1)[1] for p in tmp_path.glob(f"{phase}-written-by-*"))
    assert writers("node-local") == ["0", "2"]  # one copy per node-local cache, never by local rank 1
    assert writers("shared") in (["0"], ["2"])  # a shared cache is written once


def _start_run_in(rank, world_size, run_dirs):
    from vistrain.methods import load_config
    from vistrain.runtime.run_setup import start_run

    try:
        start_run(load_config(["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={run_dirs[rank]}"]))
    except RuntimeError as exc:
        return str(exc)
    return "started"


def test_run_dir_must_be_shared_by_all_ranks(tmp_path):
    shared = str(tmp_path / "shared")
    assert run_on_ranks(_start_run_in, 2, [shared, shared]) == ["started"] * 2
    assert os.listdir(shared) == ["log.txt"]  # rank 0's log; the probe is gone
    local = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    errors = run_on_ranks(_start_run_in, 2, local)
    for run_dir, error in zip(local, errors):  # every rank stops, naming the rank that is blind
        assert error.startswith(f"CHECKPOINT.DIR {run_dir} is not shared: ranks [1] do not see")


if __name__ == "__main__":
    # torchrun worker for the elastic test: python tests/test_multinode.py KILL_AT MARKER ARGS...
    from vistrain.cli import main  # what tools/run_distributed.py runs

    _die_once_before_step(int(sys.argv[1]), Path(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
