"""Prints the planner's fastest fitting knobs for SEER RegNetY-10B on 40 and 80 GB GPUs.

The planner's per-GPU plan for SEER RegNetY-10B (SwAV on the shipped RegNetY-256GF recipe with
the 10B trunk: head [28280, 8192, 256], 16,000 prototypes, 2x224 + 4x96 crops, 8 images per GPU,
LARS), with and without the optimizer step inside backward, on 40 and 80 GB GPUs at 8, 64 and 512
ranks: the fastest knob setting whose plan fits 95% of the GPU (``search --device cuda``).

    python dev/nodes/plan_seer_10b.py

Planner numbers only: not run on GPUs.
"""

from vistrain.methods import load_config
from vistrain.planner.knobs import search
from vistrain.planner.memory import MIB

# the recipe trains with LARS already
SEER_10B = [
    "config=pretrain/swav_regnet_y_256gf_seer",
    "config.MODEL.TRUNK.REGNET.NAME=regnet_y_10b",
    "config.MODEL.HEAD.DIMS=[28280,8192,256]",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
]


def describe(knobs) -> str:
    parts = ["ZeRO-3" if knobs["reshard_after_forward"] else "ZeRO-2"]
    parts += ["bf16"] if knobs["mixed_precision"] else []
    parts += ["activation checkpointing"] if knobs["activation_checkpointing"] else []
    parts += ["step in backward"] if knobs["step_in_backward"] else []
    return ", ".join(parts)


def main():
    print("| GPUs | step in backward | 40 GB | 80 GB |\n|---|---|---|---|")
    for ranks in (8, 64, 512):
        for in_backward in (False, True):
            cells = []
            for gib in (40, 80):
                cfg = load_config(
                    [
                        *SEER_10B,
                        "config.DISTRIBUTED.NUM_NODES=1",
                        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={ranks}",
                    ]
                )
                knobs, plan = search(cfg, 0.95 * gib * 1024, "cuda", ranks, step_in_backward=in_backward)
                cells.append(
                    f"{plan.peak / MIB / 1024:.1f} GB: {describe(knobs)} "
                    f"(grads {plan.grads / MIB / 1024:.1f} GB)"
                    if knobs
                    else f"does not fit (smallest {plan.peak / MIB / 1024:.1f} GB)"
                )
            print(f"| {ranks} | {'yes' if in_backward else 'no'} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
