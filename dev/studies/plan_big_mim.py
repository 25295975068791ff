"""Prints the planner's per-GPU memory for MAE ViT-H/14 and DINOv2 ViT-g/14 on 8, 32 and 128 H100s.

The plan ``tools/plan_memory.py --gpu h100-80gb`` makes for each (recipe, GPUs): the memory per
GPU by kind, the knobs the auto-tuner picks for 90% of the GPU (the recipes' other settings as
shipped) and whether it fits, and how long planning took (the meta build and traced forward).

* MAE: ``pretrain/mae_vit_demo`` with ViT-H/14 at 224 px (32 blocks, width 1280, 16 heads, a GELU
  MLP of 5120), the decoder 8 blocks x 512 (16 heads), 64 images per GPU (the paper's 4096 on 64),
  a quarter of the 256 patches through the encoder.
* DINOv2: ``pretrain/dinov2_vit_demo`` with ViT-g/14 (40 blocks, width 1536, 24 heads, a GELU MLP of
  6144 where DINOv2 has SwiGLU), 2 global crops of 224 px and 8 local of 98 px, 32 images per GPU,
  DINOv2's heads (2048 hidden, bottleneck 384, 131,072 prototypes, a separate iBOT head as wide).

Both with bf16 gathers and compute (MODEL.FSDP_CONFIG.mixed_precision) on NUM_NODES x 8 GPUs.

    python dev/studies/plan_big_mim.py

Planner numbers only: not run on GPUs.
"""

import time

from vistrain.config import explicit_keys
from vistrain.methods import load_config
from vistrain.planner.report import gpu_budget, planned_run
from vistrain.planner.shape import MIB

GPU = "h100-80gb"
COMMON = ["config.MACHINE.DEVICE=cuda", "config.MODEL.FSDP_CONFIG.mixed_precision=True"]
VIT = "config.MODEL.TRUNK.VIT.{}"
RECIPES = {
    "MAE ViT-H/14": [
        "config=pretrain/mae_vit_demo",
        VIT.format("NAME=huge"), VIT.format("PATCH_SIZE=14"), VIT.format("IMAGE_SIZE=224"),
        "config.MODEL.HEAD.DIMS=[1280,512]", "config.MODEL.HEAD.DECODER_DEPTH=8",
        "config.MODEL.HEAD.DECODER_HEADS=16",
        "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[224]", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=64",
    ],
    "DINOv2 ViT-g/14": [
        "config=pretrain/dinov2_vit_demo",
        VIT.format("NAME=giant"), VIT.format("PATCH_SIZE=14"), VIT.format("IMAGE_SIZE=224"),
        "config.MODEL.HEAD.DIMS=[1536,2048,2048,384]", "config.MODEL.HEAD.OUT_DIM=131072",
        "config.MODEL.HEAD.PATCH_OUT_DIM=131072",
        "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2,8]", "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[224,98]",
        "config.DATA.TRAIN.TRANSFORMS.CROP_SCALES=[[0.32,1.0],[0.05,0.32]]",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32",
    ],
}  # fmt: skip
KINDS = ("params", "grads", "optimizer_state", "teacher_params", "gathered_units", "activations")


def knobs_of(shape) -> str:
    parts = ["ZeRO-3" if shape.reshard_after_forward else "ZeRO-2", f"{shape.wrap_granularity} units"]
    parts += ["checkpointing"] if shape.activation_checkpointing else []
    parts += ["step in backward"] if shape.step_in_backward else []
    parts += [f"shard groups of {shape.shard_group_size}"] if shape.shard_group_size else []
    return ", ".join(parts)


def main():
    print("| recipe | GPUs | " + " | ".join(KINDS) + " | peak | knobs | fits | planned in |")
    print("|---" * (len(KINDS) + 6) + "|")
    for name, args in RECIPES.items():
        for gpus in (8, 32, 128):
            argv = [*args, *COMMON, f"config.DISTRIBUTED.NUM_NODES={gpus // 8}",
                    "config.DISTRIBUTED.NUM_PROC_PER_NODE=8"]  # fmt: skip
            started = time.perf_counter()
            run = planned_run(load_config(argv), "cuda", gpu_budget(GPU), explicit_keys(argv))
            seconds = time.perf_counter() - started
            memory = run.memory
            cells = [f"{getattr(memory, kind) / MIB / 1024:.1f}" for kind in KINDS]
            fits = "yes" if run.tuned_fits else "no"
            print(
                f"| {name} | {gpus} | " + " | ".join(cells) + f" | {memory.peak / MIB / 1024:.1f} | "
                f"{knobs_of(run.shape)} | {fits} | {seconds:.0f} s |"
            )
    print(f"\nGiB per GPU; fits: the auto-tuner's plan within 90% of the {GPU} ({GPU.split('-')[1]})")


if __name__ == "__main__":
    main()
