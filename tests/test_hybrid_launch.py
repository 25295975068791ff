"""shard_group_size values that cannot split the ranks exit 2 with one line before anything starts.

The launcher's 2-node mode and torchrun 2x2 with a shard group per "node" are trained end to end
in ``test_multinode.py`` (its 4-rank jobs run hybrid sharding).
"""

from vistrain import cli

HYBRID = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.MODEL.FSDP_CONFIG.shard_group_size=2"]


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
