#!/usr/bin/env python
"""Predict the peak memory per rank of a training run, or find knobs that fit a budget.

    python tools/plan_memory.py config=regnet_fsdp [config.X=Y ...] [--device cpu|cuda]
    python tools/plan_memory.py config=... --budget-mib 4000 [--max-ranks 16]

Takes the same arguments as tools/run_distributed.py. Prints JSON: ``peak_mib_per_rank`` (what
the run logs as ``mem``: peak RSS on CPU, peak allocated memory on CUDA) and its breakdown; with
``--budget-mib`` the fastest knob setting that fits and its ``config.X=Y`` overrides, or one
line saying that nothing fits, with the smallest peak reached. With ``MODEL.FSDP_CONFIG.AUTO_TUNE``
on (the shipped recipes) and no ``--budget-mib``, it plans what the run would choose and prints
its ``auto_tune`` line. The plan also gives the bytes each rank sends per step inside its
shard group and across groups (hybrid sharding, ``MODEL.FSDP_CONFIG.shard_group_size``), and
``cross_node_mib``: what the busiest node's link carries each way per step (every collective as
the backend sends it) divided by its ranks; with ``--link-gbps G`` the predicted step time on such
a link. See vistrain/planner/memory.py and traffic.py.
"""

import argparse
import json
import sys

from vistrain.config import OneLineExit, load_config
from vistrain.config.checks import check_world_size


def main(argv) -> int:
    """Exit 0 (planned), 1 (nothing fits the budget), 2 (bad input: one line on stderr, as
    tools/run_distributed.py prints it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: MACHINE.DEVICE")
    parser.add_argument("--budget-mib", type=float, default=None)
    parser.add_argument("--max-ranks", type=int, default=None, help="search up to this many ranks")
    parser.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="also predict the step time on a link this fast (Gbit/s)",
    )
    args, config_args = parser.parse_known_args(argv)
    try:
        cfg = load_config(config_args)  # the methods' sections held open: typos answered before torch
        check_world_size(cfg, cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE)
        from vistrain.jobs import checked_config

        cfg = checked_config(config_args)  # the launcher's checks: the same one line for the same mistake
        return _plan(cfg, config_args, args)
    except OneLineExit as e:
        print(e.line(), file=sys.stderr)
        return e.exit_code


def _plan(cfg, config_args, args) -> int:
    from vistrain.planner.knobs import overrides, search
    from vistrain.planner.memory import plan
    from vistrain.planner.traffic import traffic

    device = args.device or ("cpu" if cfg.MACHINE.DEVICE == "cpu" else "cuda")
    if args.budget_mib is None:
        tuned = {}
        if cfg.MODEL.FSDP_CONFIG.AUTO_TUNE:  # plan what the run would run
            from vistrain.planner.auto_tune import tune_job

            result = tune_job(cfg, config_args)
            cfg, tuned["auto_tune"] = result.cfg, result.line
        out = {**tuned, **plan(cfg, device).as_mib()}
        # inside the shard group / across groups (sharded) / over the busiest link, per rank
        out["sent_per_step_per_rank"] = traffic(cfg).as_mib()
        if args.link_gbps:
            out["predicted_step"] = _predicted_step(cfg, args.link_gbps, device)
        print(json.dumps(out, indent=2))
        return 0
    knobs, result = search(cfg, args.budget_mib, device, args.max_ranks)
    if knobs is None:
        print(
            f"nothing fits {args.budget_mib:.0f} MiB per rank; the smallest reachable peak is "
            f"{result.peak / 2**20:.0f} MiB"
        )
        return 1
    print(
        json.dumps(
            {**result.as_mib(), "knobs": knobs, "overrides": overrides(knobs, cfg.DISTRIBUTED.NUM_NODES)},
            indent=2,
        )
    )
    return 0


def _predicted_step(cfg, gbps: float, device: str) -> dict:
    """The planner's step time on a link of ``gbps``, the compute measured here as a rank of the
    run would (its threads, unit by unit: vistrain/planner/compute.py)."""
    import os

    import torch

    from vistrain.planner.compute import compute_seconds
    from vistrain.planner.traffic import predicted_step_seconds

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.DISTRIBUTED.NUM_PROC_PER_NODE))
    compute = compute_seconds(cfg, torch.device(device))
    seconds = predicted_step_seconds(cfg, gbps * 1e9 / 8, compute)
    return {"link_gbps": gbps, "compute_s": round(compute, 3), "seconds": round(seconds, 3)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
