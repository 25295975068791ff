"""Prints the planner's per-GPU memory and link bytes of full vs hybrid sharding, SEER RegNetY-10B.

Full vs hybrid sharding for SEER RegNetY-10B on 64 nodes x 8 GPUs, by the planner (no GPU).

    python dev/nodes/plan_hybrid.py [--nodes 64] [--per-node 8]

The SEER-10B recipe of docs/engine.md (SwAV, head [28280, 8192, 256], 16000 prototypes, 2x224 + 4x96
crops, 8 images per GPU, LARS, bf16 with fp32 reductions, activation checkpointing) planned with
``MODEL.FSDP_CONFIG.shard_group_size`` 0 (shards over all GPUs) and the GPUs of one node (and
two), ZeRO-3 and ZeRO-2: per-GPU memory (``vistrain.planner.memory.plan``, CUDA) and the
bytes each GPU sends per step inside its shard group and across groups (ring accounting) and
what each node's link carries per GPU (``vistrain.planner.traffic.traffic``: every collective as
one ring in rank order sends it, NCCL on CUDA: the engine reduce-scatters). Built on the meta
device.
"""

import argparse

from plan_seer_10b import SEER_10B

from vistrain.methods import load_config
from vistrain.planner.memory import plan
from vistrain.planner.shape import ModelShapes, run_shape
from vistrain.planner.traffic import traffic


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    args = parser.parse_args()
    world = args.nodes * args.per_node
    shapes = None
    print(f"SEER RegNetY-10B, {args.nodes} nodes x {args.per_node} GPUs, bf16, per GPU and step (GB = 1e9 B)")
    header = ("shard_group_size", "ZeRO", "memory GB", "in group GB", "across groups GB", "across nodes GB")
    print(" | ".join(header))
    for k in (0, 2 * args.per_node, args.per_node):
        for reshard in (True, False):
            cfg = load_config(
                SEER_10B
                + [
                    f"config.DISTRIBUTED.NUM_NODES={args.nodes}",
                    f"config.DISTRIBUTED.NUM_PROC_PER_NODE={args.per_node}",
                    f"config.MODEL.FSDP_CONFIG.shard_group_size={k}",
                    f"config.MODEL.FSDP_CONFIG.reshard_after_forward={reshard}",
                ]
            )
            shapes = shapes or ModelShapes(cfg.MODEL)
            shape = run_shape(cfg, shapes)
            memory = plan(shape, "cuda").peak
            sent = traffic(shape)
            row = [f"{k} ({k or world} GPUs)", "3" if reshard else "2"]
            row += [f"{b / 1e9:.1f}" for b in (memory, sent.shard_group, sent.replica_group, sent.cross_node)]
            print(" | ".join(row))


if __name__ == "__main__":
    main()
