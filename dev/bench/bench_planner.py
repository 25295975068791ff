"""Prints the planner's peak memory per rank beside the mem that each case's run logs.

How close ``tools/plan_memory.py`` is to what runs log, at default settings: for each case the
planned peak per rank next to the logged ``mem`` (CPU: peak RSS of the busiest rank).

    python dev/bench/bench_planner.py [--cases quick_start 3_2gf_adamw_ckpt 8gf_zero2 ...]

Cases (4 ranks, batch 2 per rank, 28 px crops, 16 images, SimCLR head, unless said otherwise):
the quick start as shipped (2 ranks, 1,280 digits, auto-tuned: planned as the run tunes it); RegNetY-3.2GF with AdamW and activation
checkpointing; RegNetY-8GF ZeRO-2, with one unit per stage, and as one unit (wrap granularity
"model") with ZeRO-2; RegNetY-32GF, also with glibc's mmap threshold fixed at 1 MiB; RegNetY-128GF with LARS (with and without the
step in backward); RegNetY-256GF with LARS and the step in backward. Runs one after the other;
a case whose plan does not fit the machine is not started. A benchmark, not a test.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_big_model import HEAD_INPUT, MARGIN_MIB, planned_mib, run_job

from vistrain.planner.auto_tune import available_memory_mib


def big(model: str, *extra: str, ranks: int = 4):
    return [
        "config=regnet_fsdp",
        f"config.MODEL.TRUNK.REGNET.NAME={model}",
        f"config.MODEL.HEAD.DIMS=[{HEAD_INPUT[model]},512,128]",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False",  # the settings each case names
        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={ranks}",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2",
        "config.DATA.TRAIN.DATA_LIMIT=16",
        "config.OPTIMIZER.num_epochs=1",
        "config.LOG_FREQUENCY=1",
        *extra,
    ]


LARS = "config.OPTIMIZER.name=lars"
IN_BACKWARD = "config.OPTIMIZER.step_in_backward=True"
CASES = {
    "quick_start": ["config=regnet_fsdp", "config.OPTIMIZER.num_epochs=1"],
    "3_2gf_adamw_ckpt": big(
        "regnet_y_3_2gf",
        "config.OPTIMIZER.name=adamw",
        "config.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING=True",
    ),
    "8gf_zero2": big("regnet_y_8gf", "config.MODEL.FSDP_CONFIG.reshard_after_forward=False"),
    "8gf_stage_units": big("regnet_y_8gf", "config.MODEL.FSDP_CONFIG.wrap_granularity=stage"),
    "8gf_one_unit_zero2": big(
        "regnet_y_8gf",
        "config.MODEL.FSDP_CONFIG.wrap_granularity=model",
        "config.MODEL.FSDP_CONFIG.reshard_after_forward=False",
    ),
    "32gf": big("regnet_y_32gf"),
    "32gf_mmap_threshold": big("regnet_y_32gf", "config.MACHINE.CPU_MMAP_THRESHOLD_MIB=1"),
    "128gf_lars": big("regnet_y_128gf", LARS),
    "128gf_lars_in_backward": big("regnet_y_128gf", LARS, IN_BACKWARD),
    "256gf_lars_in_backward": big("regnet_y_256gf", LARS, IN_BACKWARD),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    for name in args.cases:
        cfg_args = CASES[name]
        plan = planned_mib(cfg_args, "builtin")
        ranks = next((int(a.split("=")[1]) for a in cfg_args if "NUM_PROC_PER_NODE" in a), 2)
        if plan * ranks + MARGIN_MIB > available_memory_mib():
            print(
                f"{name:<24} planned {plan:6.0f} MiB x {ranks} ranks: does not fit, not started", flush=True
            )
            continue
        r = run_job(cfg_args)
        print(
            f"{name:<24} planned {plan:6.0f} MiB  logged {r['peak']:6d} MiB  ({r['peak'] / plan - 1:+.1%})  "
            f"PSS sum {r['pss_sum']:6.0f} MiB  MemAvailable drop {r['available_drop']:6.0f} MiB  "
            f"{r['wall_s']:4.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
