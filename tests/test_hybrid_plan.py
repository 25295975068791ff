"""The planner with hybrid sharding: state per rank shrinks as 1/k, and the bytes each rank sends
per step inside its shard group, across groups (ring accounting) and over each node's link (gloo's
algorithms, collective by collective)."""

import pytest

from vistrain.methods import build_meta_model, load_config
from vistrain.planner import collectives
from vistrain.planner.collectives import Collective
from vistrain.planner.memory import plan
from vistrain.planner.shape import run_shape
from vistrain.planner.traffic import link_breakdown, traffic, traffic_bytes


def test_traffic_of_full_and_hybrid_sharding_by_hand():
    """Units of 100, 100 and a root of 10 elements, 16 ranks, fp32, ZeRO-3: bytes per rank by group."""
    full = traffic_bytes([100, 100, 10], 16, 0, 4, 4, reshard=True)
    # padded to 112, 112, 16: gathered 2 * 112 * 2 + 16 (root once), reduce-scattered 240
    assert full["shard_group"] == pytest.approx(15 / 16 * (464 + 240) * 4)
    assert full["replica_group"] == 0
    hybrid = traffic_bytes([100, 100, 10], 16, 8, 4, 4, reshard=True)
    # padded to 104, 104, 16; 2 replicas all-reduce the 224 / 8 shard elements
    assert hybrid["shard_group"] == pytest.approx(7 / 8 * (2 * 104 * 2 + 16 + 224) * 4)
    assert hybrid["replica_group"] == pytest.approx(2 * 1 / 2 * 28 * 4)
    zero2 = traffic_bytes([100, 100, 10], 16, 8, 2, 4, reshard=False)  # bf16 gathers, once
    assert zero2["shard_group"] == pytest.approx(7 / 8 * (224 * 2 + 224 * 4))
    ddp_like = traffic_bytes([100, 100, 10], 16, 1, 4, 4, reshard=True)  # groups of one rank
    assert ddp_like["shard_group"] == 0 and ddp_like["replica_group"] == pytest.approx(2 * 15 / 16 * 210 * 4)
    assert traffic_bytes([100, 100, 10], 16, 16, 4, 4, reshard=True) == full  # k = world: full


def _cfg(*overrides):
    return load_config(
        ["config=test/simclr_tiny", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", *overrides]
    )


def test_state_per_rank_follows_the_shard_group_not_the_world():
    hybrid = plan(
        run_shape(
            _cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=4", "config.MODEL.FSDP_CONFIG.shard_group_size=2")
        )
    )
    two = plan(run_shape(_cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=2")))
    four = plan(run_shape(_cfg("config.DISTRIBUTED.NUM_PROC_PER_NODE=4")))
    for key in ("params", "grads", "optimizer_state"):
        assert getattr(hybrid, key) == getattr(two, key) > getattr(four, key)
    nodes = ["config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]
    per_node = traffic(run_shape(_cfg(*nodes, "config.MODEL.FSDP_CONFIG.shard_group_size=2")))
    over_all = traffic(run_shape(_cfg(*nodes)))
    assert 0 < per_node.cross_node < over_all.cross_node


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


# --------------------------------------------------------------------------------------------
# what gloo sends over the links (vistrain/planner/collectives.py; measured: dev/nodes/probe_gloo_link.py)

SENT, RETURNED = collectives.MESSAGE_BYTES_SENT, collectives.MESSAGE_BYTES_RETURNED


def _by_node(op, nbytes, groups, per_node=2):
    return collectives.node_link_bytes(Collective(op, nbytes, groups), lambda r: r // per_node)


def test_gloo_rings_and_trees_cross_the_link_where_the_ranks_are():
    world = ((0, 1, 2, 3),)  # 2 nodes x 2 ranks
    # all-gather: a ring 0 -> 1 -> 2 -> 3 -> 0; 1 -> 2 and 3 -> 0 cross, each with 3 of 4 pieces
    assert _by_node("all_gather", 4000, world) == {
        0: 3000 + 6 * (SENT + RETURNED),
        1: 3000 + 6 * (SENT + RETURNED),
    }
    # all-reduce: the other way (0 -> 3, 2 -> 1 cross), 2 (P - 1) / P of the tensor each
    assert _by_node("all_reduce", 4000, world)[0] == 6000 + 12 * (SENT + RETURNED)
    # broadcast from 0: a binomial tree 0 -> 1, then 0 -> 2 and 1 -> 3: node 0 sends it twice
    assert _by_node("broadcast", 4000, world) == {0: 8000 + 2 * SENT, 1: 2 * RETURNED}
    # hybrid's replica groups: every edge crosses; two groups at once
    assert _by_node("all_reduce", 4000, ((0, 2), (1, 3)))[0] == 2 * (4000 + 4 * (SENT + RETURNED))
    assert _by_node("all_gather", 4000, ((0, 1), (2, 3))) == {}  # a shard group per node
    # 3 nodes of 2: the ring crosses once per node boundary; the busiest link carries one edge
    ring = _by_node("all_gather", 6000, ((0, 1, 2, 3, 4, 5),))
    assert ring == dict.fromkeys(range(3), 5000 + 10 * (SENT + RETURNED))
    # one rank per node: every edge crosses
    assert _by_node("all_reduce", 4000, ((0, 1, 2, 3),), per_node=1)[0] == 6000 + 12 * (SENT + RETURNED)


def test_the_link_model_of_full_hybrid_and_ddp():
    """RegNetY-400MF on 2 nodes x 2 ranks, fp32, ZeRO-3, SyncBN (the two-host benchmark's runs):
    full sharding's link carries its weights 3 times (two gathers at 3/4, a reduction at 3/2), DDP's
    its gradients 1.5 times, hybrid's once (each host's two ranks all-reduce half of them)."""
    nodes = [
        "config=regnet_fsdp", "config.MODEL.TRUNK.REGNET.NAME=regnet_y_400mf", "config.MODEL.HEAD.DIMS=[440,512,128]",
        "config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False",
    ]  # fmt: skip
    ddp = load_config([*nodes, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"])
    weights = sum(p.numel() for p in build_meta_model(ddp.MODEL).parameters()) * 4
    links = {}
    for k in ("ddp", 0, 2):
        cfg = ddp if k == "ddp" else load_config([*nodes, f"config.MODEL.FSDP_CONFIG.shard_group_size={k}"])
        links[k] = link_breakdown(run_shape(cfg))
        assert traffic(run_shape(cfg)).cross_node * 2 == pytest.approx(sum(links[k].values()))
    assert links["ddp"]["gradient reductions"] == pytest.approx(1.5 * weights, rel=0.01)
    assert links[0]["gathers"] + links[0]["gradient reductions"] == pytest.approx(3 * weights, rel=0.01)
    assert links[2]["replica all-reduces"] == pytest.approx(weights, rel=0.01)
    assert links[2]["sync BN"] == links[0]["sync BN"] > 0
