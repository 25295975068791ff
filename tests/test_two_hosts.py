"""Two hosts for real: the launcher's multi-node mode across two network namespaces joined by a
veth pair (``vistrain/distributed/netns.py``), one launcher per host, 2 ranks each.

Hybrid sharding (a shard group per host) must train to the losses of full sharding, and the bytes
host A sends over the link per step (a 4-step run minus a 2-step run: start-up cancels) must be
within 15% of the planner's (``traffic.traffic``: ``cross_node`` x ranks per node). Needs root and
iproute2 (``ip``, ``tc``); skipped with the reason otherwise.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vistrain.distributed.netns import two_hosts, unavailable_reason
from vistrain.methods import load_config
from vistrain.planner.shape import run_shape
from vistrain.planner.traffic import traffic

REPO = Path(__file__).resolve().parents[1]
RUN = str(REPO / "tools" / "run_distributed.py")
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


def _job(hosts, run_dir: Path, port: int, *overrides):
    """Run one two-host job; (bytes host A sent, losses)."""
    args = [
        *TINY,
        f"config.CHECKPOINT.DIR={run_dir}",
        f"config.DISTRIBUTED.RUN_ID={hosts.addresses[0]}:{port}",
    ]
    sent = hosts.tx_bytes(0)
    procs = []
    for host in (0, 1):
        argv = [sys.executable, RUN, *args, *overrides, f"config.DISTRIBUTED.NODE_ID={host}"]
        log = open(f"{run_dir}.host{host}.log", "w")  # noqa: SIM115  closed below
        procs.append(
            (
                subprocess.Popen(
                    hosts.command(host, argv),
                    env=hosts.env(host),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                ),
                log,
            )
        )
    try:
        for proc, _ in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for host, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, Path(f"{run_dir}.host{host}.log").read_text()[-4000:]
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return hosts.tx_bytes(0) - sent, torch.tensor([r["loss"] for r in records], dtype=torch.float64)


def test_hybrid_equals_full_sharding_and_the_link_carries_what_the_planner_says(tmp_path):
    runs = {}
    with two_hosts() as hosts:
        for port, (k, steps) in enumerate(((0, 4), (0, 2), (2, 4), (2, 2)), start=29511):
            overrides = (
                f"config.MODEL.FSDP_CONFIG.shard_group_size={k}",
                f"config.DATA.TRAIN.DATA_LIMIT={16 * steps}",
            )
            runs[k, steps] = _job(hosts, tmp_path / f"k{k}-{steps}", port, *overrides)
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
