"""Two hosts for real: the launcher's multi-node mode across two network namespaces joined by a
veth pair (``vistrain/distributed/netns.py``), one launcher per host, 2 ranks each (the command
line's launcher, each forked from one interpreter per host: ``tests/fresh_launcher.py``).

Hybrid sharding (a shard group per host) must train to the losses of full sharding, and the bytes
host A sends over the link per step (a 4-step run minus a 2-step run: start-up cancels) must be
within 15% of the planner's (``traffic.traffic``: ``cross_node`` x ranks per node). Needs root and
iproute2 (``ip``, ``tc``); skipped with the reason otherwise.
"""

import json
from pathlib import Path

import pytest
import torch
from fresh_launcher import FreshLauncher

from vistrain.distributed.netns import two_hosts, unavailable_reason
from vistrain.methods import load_config
from vistrain.planner.shape import run_shape
from vistrain.planner.traffic import traffic

TIMEOUT = 300
# the tiny recipe with a wider head (its 82K weights make the step's bytes, not the headers of its
# small collectives); 16 images per step over 4 ranks
TINY = [
    "config=test/simclr_tiny",
    "config.MODEL.HEAD.DIMS=[16,1024,64]",
    "config.DATA.TRAIN.SYNTHETIC_SIZE=64",
    "config.OPTIMIZER.num_epochs=1",
    "config.LOG_FREQUENCY=1",
    "config.DISTRIBUTED.NUM_NODES=2",
    "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
    "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
]
REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two hosts need network namespaces: {REASON}")


def _job(launchers, hosts, run_dir: Path, port: int, *overrides):
    """Run one two-host job, the launcher of each host forked by its ``launchers`` interpreter;
    (bytes host A sent, losses)."""
    args = [
        *TINY,
        *overrides,
        f"config.CHECKPOINT.DIR={run_dir}",
        f"config.DISTRIBUTED.RUN_ID={hosts.addresses[0]}:{port}",
    ]
    sent = hosts.tx_bytes(0)
    for host, launcher in enumerate(launchers):
        launcher.start([*args, f"config.DISTRIBUTED.NODE_ID={host}"], Path(f"{run_dir}.host{host}.log"))
    for host, launcher in enumerate(launchers):
        code = launcher.wait(TIMEOUT)
        assert code == 0, Path(f"{run_dir}.host{host}.log").read_text()[-4000:]
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return hosts.tx_bytes(0) - sent, torch.tensor([r["loss"] for r in records], dtype=torch.float64)


def test_hybrid_equals_full_sharding_and_the_link_carries_what_the_planner_says(tmp_path):
    runs = {}
    with two_hosts() as hosts:
        # one interpreter per host (a torch start-up each, not one per job)
        launchers = [FreshLauncher(hosts.command(host, []), hosts.env(host)) for host in (0, 1)]
        try:
            for port, (k, steps) in enumerate(((0, 4), (0, 2), (2, 4), (2, 2)), start=29511):
                overrides = (
                    f"config.MODEL.FSDP_CONFIG.shard_group_size={k}",
                    f"config.DATA.TRAIN.DATA_LIMIT={16 * steps}",
                )
                runs[k, steps] = _job(launchers, hosts, tmp_path / f"k{k}-{steps}", port, *overrides)
        finally:
            for launcher in launchers:
                launcher.close()
    full, hybrid = runs[0, 4][1], runs[2, 4][1]
    assert len(full) == 4
    torch.testing.assert_close(hybrid, full, rtol=1e-6, atol=0)  # other sums: float rounding
    for k in (0, 2):
        measured = (runs[k, 4][0] - runs[k, 2][0]) / 2
        cfg = load_config([*TINY, f"config.MODEL.FSDP_CONFIG.shard_group_size={k}"])
        planned = traffic(run_shape(cfg)).cross_node * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
        assert measured == pytest.approx(planned, rel=0.15), (k, measured, planned)
    hybrid_bytes = runs[2, 4][0] - runs[2, 2][0]
    assert hybrid_bytes < 0.5 * (runs[0, 4][0] - runs[0, 2][0])  # a shard group per host: far fewer
