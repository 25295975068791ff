#!/usr/bin/env python
"""Plan a recipe's memory per rank and its knobs, and say whether it fits; or find knobs for a budget.

    python tools/plan_memory.py config=NAME [config.X=Y ...] [--gpu h100-80gb] [--device cpu|cuda] [--json]
    python tools/plan_memory.py config=NAME ... --budget-mib 4000 [--max-ranks 16]

Takes the same arguments as tools/run_distributed.py and plans from the config alone: shapes from
the model built on the meta device and DATA.TRAIN's crops and batch; the data, the run folder and
the weights file need not exist here. Prints a table: the run (ranks, device, batch, crops,
engine, precision), its knobs (with MODEL.FSDP_CONFIG.AUTO_TUNE, the shipped recipes: those the run
would choose, for MACHINE.MEMORY_BUDGET_MIB, else the ``--gpu``, else this machine), the peak
memory per rank by kind (what the run logs as ``mem``: peak RSS on CPU, peak allocated memory on
CUDA), whether it fits this machine (CPU: MemAvailable shared by its ranks; CUDA: its GPU) and the
named GPU, and the bytes a rank sends per step (vistrain/planner/traffic.py). ``--json`` prints
the same as JSON; ``--link-gbps G`` adds the predicted step time on such a link. A GPU plan
(``--gpu``, or MACHINE.DEVICE cuda) needs no GPU here.

With ``--budget-mib`` it searches every knob, result knobs included (mixed precision, batch per
replica, ranks), and prints the fastest setting that fits as JSON with its ``config.X=Y``
overrides, or one line with the smallest peak reached.

Exit 0 (planned; the table says where it fits), 1 (``--budget-mib``: nothing fits), 2 (bad input:
one line on stderr, as tools/run_distributed.py prints it).
"""

import argparse
import json
import os
import sys

from vistrain.config import ConfigError, OneLineExit, explicit_keys, load_config, require_recipe
from vistrain.config.checks import check_world_size
from vistrain.planner.gpus import GPUS

GPU_NAMES = ", ".join(GPUS)


def main(argv) -> int:
    """Exit 0 (planned), 1 (nothing fits the budget), 2 (bad input: one line on stderr, as
    tools/run_distributed.py prints it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default=None, help=f"also say whether it fits this GPU: {GPU_NAMES}")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: MACHINE.DEVICE")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
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
        require_recipe(config_args)
        check_world_size(cfg, cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE)
        from vistrain.jobs import checked_config

        # the launcher's checks but those of the data, run folder and weights file: the same one line
        cfg = checked_config(config_args, files=False)
        device = _device(cfg, args)
        if args.budget_mib is not None:
            return _search(cfg, args, device)
        return _plan(cfg, config_args, args, device)
    except OneLineExit as e:
        print(e.line(), file=sys.stderr)
        return e.exit_code


def _device(cfg, args) -> str:
    """``--device``; else cuda for ``--gpu`` or MACHINE.DEVICE cuda; auto: cuda when one is here."""
    if args.gpu and args.device == "cpu":
        raise ConfigError(f"--gpu {args.gpu} plans for a GPU; drop --device cpu")
    if args.device:
        return args.device
    if args.gpu or cfg.MACHINE.DEVICE == "cuda":
        return "cuda"
    if cfg.MACHINE.DEVICE == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _plan(cfg, config_args, args, device: str) -> int:
    from vistrain.planner.auto_tune import Budget
    from vistrain.planner.report import gpu_budget, planned_run, report, table, this_machine_budget

    named = gpu_budget(args.gpu) if args.gpu else None
    here = this_machine_budget(device, cfg.DISTRIBUTED.NUM_PROC_PER_NODE)
    budget = here if named is None else named
    if cfg.MACHINE.MEMORY_BUDGET_MIB > 0:  # what the run tunes for
        budget = Budget(cfg.MACHINE.MEMORY_BUDGET_MIB, "MACHINE.MEMORY_BUDGET_MIB")
    run = planned_run(cfg, device, budget, explicit_keys(config_args))
    places = [("this machine", here, "no: no GPU here (the plan is for cuda)")]
    if named is not None:
        places.append((args.gpu, named, ""))
    elif device == "cuda" or cfg.MACHINE.DEVICE == "auto":  # auto: a GPU where the run finds one
        places.append(("a GPU", None, f"plan for one with --gpu NAME ({GPU_NAMES})"))
    out = report(run, _name(config_args), places)
    if args.link_gbps and device == "cuda" and here is None:
        raise ConfigError("--link-gbps times the compute on this machine, which has no GPU: add --device cpu")
    if args.link_gbps:
        out["predicted_step"] = _predicted_step(run.shape, args.link_gbps, device)
    print(json.dumps(out, indent=2) if args.json else table(out))
    return 0


def _search(cfg, args, device: str) -> int:
    from vistrain.planner.knobs import overrides, search

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


def _name(config_args) -> str:
    return next(arg[len("config=") :] for arg in config_args if arg.startswith("config="))


def _predicted_step(shape, gbps: float, device: str) -> dict:
    """The planner's step time on a link of ``gbps`` for ``shape`` (a RunShape), the compute
    measured here as a rank of the run would (its threads, unit by unit: vistrain/planner/compute.py)."""
    import torch

    from vistrain.planner.compute import compute_seconds
    from vistrain.planner.traffic import predicted_step_seconds

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // shape.ranks_per_node))
    compute = compute_seconds(shape, torch.device(device))
    seconds = predicted_step_seconds(shape, gbps * 1e9 / 8, compute)
    return {"link_gbps": gbps, "compute_s": round(compute, 3), "seconds": round(seconds, 3)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
