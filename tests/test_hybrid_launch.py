"""shard_group_size end to end: the launcher's 2-node mode and torchrun with 2 nodes x 2 ranks on
127.0.0.1 train the tiny recipe with a shard group per "node" and equal the single-node run;
values that cannot split the ranks exit 2 with one line before anything starts.

Helpers and the DDP reference come from ``test_multinode.py`` (same recipe, same seeds).
"""

import sys

import test_multinode as mn
import torch

from vistrain import cli
from vistrain.distributed.launch import find_free_port

HYBRID = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.MODEL.FSDP_CONFIG.shard_group_size=2"]


def _losses(run_dir):
    got = mn._losses(run_dir)
    return torch.tensor([got[i] for i in sorted(got)], dtype=torch.float64)


def test_two_nodes_with_a_shard_group_each_equal_the_single_node_run(tmp_path):
    """The launcher's 2-node mode and torchrun 2x2 (c10d rendezvous) with shard_group_size=2 give
    the losses of one node of 4 ranks with the same groups (same sums: to float rounding), and
    of DDP on 4 ranks (other sums: close)."""
    single = tmp_path / "single"
    command = [sys.executable, mn.RUN, *mn._args(single, *HYBRID, "config.DISTRIBUTED.NUM_PROC_PER_NODE=4")]
    mn._run_together([command], single)
    ddp = tmp_path / "ddp"
    mn._run_together(
        [[sys.executable, mn.RUN, *mn._args(ddp, "config.DISTRIBUTED.NUM_PROC_PER_NODE=4")]], ddp
    )
    torch.testing.assert_close(_losses(single), _losses(ddp), rtol=1e-5, atol=0)

    launcher, port = tmp_path / "launcher", find_free_port()
    nodes = [
        [
            sys.executable,
            mn.RUN,
            *mn._args(launcher, *HYBRID),
            "config.DISTRIBUTED.NUM_NODES=2",
            f"config.DISTRIBUTED.NODE_ID={node}",
            f"config.DISTRIBUTED.RUN_ID=127.0.0.1:{port}",
        ]
        for node in range(2)
    ]
    mn._run_together(nodes, launcher)
    mn._assert_same_losses(launcher, mn._losses(single), iterations=4)
    mn._assert_rank0_side_effects(launcher, iterations=4)

    torchrun, port = tmp_path / "torchrun", find_free_port()
    agents = [
        [
            *mn.TORCHRUN,
            "--nnodes=2",
            "--nproc_per_node=2",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=vistrain_hybrid",
            f"--rdzv_conf=is_host={int(node == 0)}",
            "--local_addr=127.0.0.1",
            mn.RUN,
            *mn._args(torchrun, *HYBRID),
        ]
        for node in range(2)
    ]
    mn._run_together(agents, torchrun)
    mn._assert_same_losses(torchrun, mn._losses(single), iterations=4)


def _refused(capsys, *overrides):
    code = cli.main(["config=test/simclr_tiny", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def test_shard_group_sizes_that_cannot_split_the_ranks_exit_2_with_one_line(tmp_path, capsys):
    run_dir = f"config.CHECKPOINT.DIR={tmp_path / 'run'}"
    code, lines = _refused(capsys, run_dir, "config.MODEL.FSDP_CONFIG.shard_group_size=-1")
    assert code == 2 and lines == ["config error: MODEL.FSDP_CONFIG.shard_group_size must be >= 0; got -1"]
    bad = [run_dir, *HYBRID[:1], "config.MODEL.FSDP_CONFIG.shard_group_size=3"]
    code, lines = _refused(capsys, *bad, "config.DISTRIBUTED.NUM_PROC_PER_NODE=4")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        "config error: MODEL.FSDP_CONFIG.shard_group_size (3) must divide the world size (4); "
        "use the ranks per node or another divisor, or 0 to shard over all ranks"
    )
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
