"""Prints CUDA parity, mixed precision, offload, peak memory and speed of the engine against DDP.

One prepared CUDA check for a lent GPU machine: parity, mixed precision, offload, memory, speed.

    python dev/gpu/gpu_check.py [--out DIR]      # writes DIR/gpu_check.json and prints a summary

On each visible GPU count (one H200 in this project's device sessions: world size 1 with NCCL)
it trains torchvision's RegNetY-400MF for a few steps under DDP and under our engine and records:
fp32 parity (losses, weights), bf16 and fp16 (model.grad_scaler()) runs against fp32, the
move_params_to_cpu path, peak CUDA memory of each, and median step times. CPU-only machines:
exits with a message (the CPU paths are covered by the test suite).
"""

import argparse
import json
import os
import statistics
import time

import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.models.regnet import ResBottleneckBlock, SimpleStemIN

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import KEEP_FP32, Precision, auto_wrap, by_class

UNITS = by_class(
    {ResBottleneckBlock: {}, SimpleStemIN: {}, nn.Linear: {}, nn.BatchNorm2d: {"precision": KEEP_FP32}}
)
STEPS = 6


def build(device):
    torch.manual_seed(0)
    model = torchvision.models.regnet_y_400mf(num_classes=10).to(device)
    return model


def run(kind, rank, world, **fsdp_kwargs):
    device = torch.device("cuda", rank)
    torch.cuda.reset_peak_memory_stats(device)
    amp = fsdp_kwargs.pop("amp", None)
    if kind == "ddp":
        model = DDP(build(device), device_ids=[rank])
    else:
        model = auto_wrap(build(device), UNITS, **fsdp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = None
    if amp == torch.float16:  # the trainer's choice (vistrain.runtime.precision.loss_scaling)
        scaler = torch.amp.GradScaler("cuda") if kind == "ddp" else model.grad_scaler()
    gen = torch.Generator().manual_seed(rank)
    losses, times = [], []
    for _ in range(STEPS):
        x = torch.randn(32, 3, 128, 128, generator=gen).to(device)
        y = torch.randint(0, 10, (32,), generator=gen).to(device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    state = model.module.state_dict() if kind == "ddp" else model.state_dict()
    return {
        "losses": losses,
        "step_s": statistics.median(times[2:]),
        "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20,
        "state": {k: v.float().cpu() for k, v in state.items()},
    }


def rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def worker(rank, world):
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runs = {
        "ddp": run("ddp", rank, world),
        "fsdp": run("fsdp", rank, world),
        "fsdp_no_reshard": run("fsdp", rank, world, reshard_after_forward=False),
        "fsdp_offload": run("fsdp", rank, world, move_params_to_cpu=True),
    }
    for name, dtype in (("fsdp_bf16", torch.bfloat16), ("fsdp_fp16", torch.float16)):
        runs[name] = run(
            "fsdp",
            rank,
            world,
            precision=Precision(dtype, torch.float32),
            amp=dtype,
        )
    ref = runs["ddp"]
    summary = {}
    for name, r in runs.items():
        summary[name] = {
            "loss_rel_diff_vs_ddp_fp32": rel(r["losses"], ref["losses"]),
            "first_loss_rel_diff": abs(r["losses"][0] - ref["losses"][0]) / ref["losses"][0],
            "weights_rel_diff": max(rel(r["state"][k], ref["state"][k]) for k in ref["state"]),
            "step_s": r["step_s"],
            "step_vs_ddp": r["step_s"] / ref["step_s"],
            "peak_mib": r["peak_mib"],
            "finite": all(v == v for v in r["losses"]),
        }
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU paths are covered by the tests)")
        return
    world = torch.cuda.device_count()
    summary = run_on_ranks(worker, world, backend="nccl")[0]
    summary["_device"] = {
        "name": torch.cuda.get_device_name(0),
        "world_size": world,
        "torch": torch.__version__,
    }
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for name, row in summary.items():
        print(name, row)
    fp32_ok = all(
        summary[k]["loss_rel_diff_vs_ddp_fp32"] < 1e-4 for k in ("fsdp", "fsdp_no_reshard", "fsdp_offload")
    )
    mixed_ok = all(
        summary[k]["finite"] and summary[k]["first_loss_rel_diff"] < 2e-2 for k in ("fsdp_bf16", "fsdp_fp16")
    )
    print("PASS" if fp32_ok and mixed_ok else "FAIL")


if __name__ == "__main__":
    main()
