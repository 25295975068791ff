"""The planner with hybrid sharding: state per rank shrinks as 1/k, and the bytes each rank sends
per step inside its shard group, across groups and across nodes (ring accounting)."""

import pytest

from vistrain.config import load_config
from vistrain.planner.memory import plan
from vistrain.planner.traffic import traffic, traffic_bytes


def test_traffic_of_full_and_hybrid_sharding_by_hand():
    """Units of 100, 100 and a root of 10 elements, 16 ranks, 8 per node, fp32, ZeRO-3."""
    full = traffic_bytes([100, 100, 10], 16, 0, 8, 4, 4, reshard=True)
    # padded to 112, 112, 16: gathered 2 * 112 * 2 + 16 (root once), reduce-scattered 240
    assert full.shard_group == pytest.approx(15 / 16 * (464 + 240) * 4)
    assert full.replica_group == 0 and full.cross_node == full.shard_group  # the world spans nodes
    hybrid = traffic_bytes([100, 100, 10], 16, 8, 8, 4, 4, reshard=True)
    # padded to 104, 104, 16; 2 replicas all-reduce the 224 / 8 shard elements
    assert hybrid.shard_group == pytest.approx(7 / 8 * (2 * 104 * 2 + 16 + 224) * 4)
    assert hybrid.replica_group == pytest.approx(2 * 1 / 2 * 28 * 4)
    assert hybrid.cross_node == hybrid.replica_group  # a node's group stays on the node
    zero2 = traffic_bytes([100, 100, 10], 16, 8, 8, 2, 4, reshard=False)  # bf16 gathers, once
    assert zero2.shard_group == pytest.approx(7 / 8 * (224 * 2 + 224 * 4))
    ddp_like = traffic_bytes([100, 100, 10], 16, 1, 8, 4, 4, reshard=True)  # groups of one rank
    assert ddp_like.shard_group == 0 and ddp_like.replica_group == pytest.approx(2 * 15 / 16 * 210 * 4)
    two_nodes = traffic_bytes([100, 100, 10], 16, 16, 4, 4, 4, reshard=True)  # k = world: full
    assert two_nodes == full


def _cfg(*overrides):
    return load_config(
        ["config=test/simclr_tiny", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", *overrides]
    )


def test_state_per_rank_follows_the_shard_group_not_the_world():
    hybrid = plan(
        _cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=4", "config.MODEL.FSDP_CONFIG.shard_group_size=2")
    )
    two = plan(_cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=2"))
    four = plan(_cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=4"))
    for key in ("params", "grads", "optimizer_state"):
        assert getattr(hybrid, key) == getattr(two, key) > getattr(four, key)
    nodes = ["config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]
    per_node = traffic(_cfg(*nodes, "config.MODEL.FSDP_CONFIG.shard_group_size=2"))
    over_all = traffic(_cfg(*nodes))
    assert 0 < per_node.cross_node == per_node.replica_group < over_all.cross_node == over_all.shard_group


def test_the_planner_refuses_groups_that_do_not_split_the_world(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "plan_memory.py"
    spec = importlib.util.spec_from_file_location("plan_memory_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = ["config=test/simclr_tiny", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"]
    assert tool.main([*argv, "config.MODEL.FSDP_CONFIG.shard_group_size=3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "config error: MODEL.FSDP_CONFIG.shard_group_size (3) must divide the world size (2); "
        "use the ranks per node or another divisor, or 0 to shard over all ranks"
    ]
