"""Prints CUDA parity, mixed precision, offload, peak memory and speed of the engine against DDP, and the views made and JPEGs decoded on the GPU against the CPU's.

One prepared CUDA check for a lent GPU machine: parity, mixed precision, offload, memory, speed.

    python dev/gpu/gpu_check.py [--out DIR]      # writes DIR/gpu_check.json and prints a summary
    python dev/gpu/gpu_check.py --only views     # just the views (DATA.TRAIN.VIEWS_ON_DEVICE)
    python dev/gpu/gpu_check.py --only decode    # just the JPEG decoding (DATA.TRAIN.DECODE_ON_DEVICE)

On each visible GPU count (one GPU in this project's device sessions: world size 1 with NCCL)
it trains torchvision's RegNetY-400MF for a few steps under DDP and under our engine and records:
fp32 parity (losses, weights), bf16 and fp16 (model.grad_scaler()) runs against fp32, the
move_params_to_cpu path, peak CUDA memory of each, and median step times. Then DINO's views
(2 x 224 + 6 x 96) of JPEG photographs, made by the loader on one CPU core and by
VIEWS_ON_DEVICE on the GPU from the same draws: ms per batch of each side, their ratio, and the
largest difference between the two paths' views. Then the same photographs decoded by nvjpeg
(``decode_jpeg(list, device="cuda")``, DECODE_ON_DEVICE) against libjpeg-turbo on one core: ms per
batch of each, the largest pixel difference, and the largest difference between DECODE_ON_DEVICE's
views and the CPU path's. CPU-only machines: exits with a message (the CPU paths are covered by
the test suite).
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


def _views_loaders(folder: str, batch: int, key: str = "VIEWS_ON_DEVICE"):
    """DINO's views of the JPEGs in ``folder``: the CPU path's loader and the device path's
    (``DATA.TRAIN.<key>`` on), in this process."""
    from vistrain.data import build_loader
    from vistrain.methods import get_defaults

    cfg = get_defaults().DATA
    cfg.NUM_DATALOADER_WORKERS = 0  # the loader's work in this process, on one thread: per core
    split = cfg.TRAIN
    split.DATA_SOURCES, split.DATA_PATHS, split.FOLDER_LABELS = ["disk_folder"], [folder], "none"
    split.BATCHSIZE_PER_REPLICA = batch
    t = split.TRANSFORMS
    t.NUM_CROPS, t.SIZE_CROPS, t.CROP_SCALES = [2, 6], [224, 96], [[0.4, 1.0], [0.05, 0.4]]
    t.SOLARIZE_PROB = 0.025
    cpu = build_loader(cfg, "TRAIN", seed=0, device=torch.device("cpu"))
    split[key] = True
    return cpu, build_loader(cfg, "TRAIN", seed=0, device=torch.device("cuda", 0))


def views_check(images: int = 192, batch: int = 64) -> dict:
    """ms per batch of the CPU path (decode, draws, views on one core) and of the device path (the
    worker's half on one core: decode, draws, packing; the views on the GPU, channels_last), the
    CPU path's views over the GPU's, and max |difference| between the two paths' views."""
    import tempfile

    from vistrain.data import set_epoch
    from vistrain.data.device_views import collate_packed, make_views

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        _photographs(folder, images)
        cpu, device = _views_loaders(folder, batch)
        set_epoch(cpu, 0)
        set_epoch(device, 0)
        start = time.perf_counter()
        cpu_batches = list(cpu)
        cpu_ms = (time.perf_counter() - start) / len(cpu_batches) * 1e3
        dataset = device.dataset
        keys = [list(b) for b in device.batch_sampler]
        start = time.perf_counter()
        packed = [collate_packed([dataset[k] for k in ks]) for ks in keys]  # the worker's half
        worker_ms = (time.perf_counter() - start) / len(packed) * 1e3
        for p in packed:
            p["packed"]["buffers"] = {k: v.pin_memory() for k, v in p["packed"]["buffers"].items()}
        made = [make_views(packed[0], dataset, device.device)]  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        made = [make_views(p, dataset, device.device) for p in packed]
        made = [[c.contiguous(memory_format=torch.channels_last) for c in m["crops"]] for m in made]
        torch.cuda.synchronize()
        gpu_ms = (time.perf_counter() - start) / len(made) * 1e3
    diff = max(
        (g.float().cpu() - c).abs().max().item()
        for m, b in zip(made, cpu_batches)
        for g, c in zip(m, b["crops"])
    )
    return {"cpu_path_ms_per_batch": cpu_ms, "worker_half_ms_per_batch": worker_ms, "gpu_views_ms_per_batch": gpu_ms,
            "cpu_views_over_gpu": (cpu_ms - worker_ms) / gpu_ms, "max_abs_diff": diff, "batch": batch}  # fmt: skip


def _photographs(folder: str, images: int, seed: int = 0) -> None:
    """``images`` smooth random RGB photographs of 200-600 px a side as JPEGs (quality 90) in ``folder``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(images):
        h, w = rng.integers(200, 601, 2)
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([np.sin(x / rng.uniform(5, 40) + y / rng.uniform(5, 40) + c) for c in range(3)], -1)
        pixels = np.clip(pixels * 100 + 128 + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i}.jpg"), quality=90)


def decode_check(images: int = 192, batch: int = 64, repeats: int = 3) -> dict:
    """ms per batch of ``batch`` JPEGs decoded by libjpeg-turbo on one core (the workers' decoder)
    and by nvjpeg (``decode_jpeg(list, device="cuda")``, bytes already in memory, best of
    ``repeats``), max |pixel difference| between the two (nvjpeg's IDCT and upsampling may differ by
    a grey level or so), and max |difference| between DECODE_ON_DEVICE's views and the CPU path's."""
    import glob
    import tempfile

    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    from vistrain.data import set_epoch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        _photographs(folder, images)
        files = [read_file(p) for p in sorted(glob.glob(os.path.join(folder, "*.jpg")))]
        batches = [files[i : i + batch] for i in range(0, len(files) - batch + 1, batch)]
        rgb = ImageReadMode.RGB
        cpu_ms, gpu_ms = float("inf"), float("inf")
        decode_jpeg(batches[0], mode=rgb, device="cuda")  # warm-up: nvjpeg's handles
        for _ in range(repeats):
            start = time.perf_counter()
            on_cpu = [decode_jpeg(b, mode=rgb) for b in batches]
            cpu_ms = min(cpu_ms, (time.perf_counter() - start) / len(batches) * 1e3)
            torch.cuda.synchronize()
            start = time.perf_counter()
            on_gpu = [decode_jpeg(b, mode=rgb, device="cuda") for b in batches]
            torch.cuda.synchronize()
            gpu_ms = min(gpu_ms, (time.perf_counter() - start) / len(batches) * 1e3)
        pixel_diff = max(
            (g.cpu().int() - c.int()).abs().max().item()
            for gb, cb in zip(on_gpu, on_cpu)
            for g, c in zip(gb, cb)
        )
        cpu, device = _views_loaders(folder, batch, key="DECODE_ON_DEVICE")
        set_epoch(cpu, 0)
        set_epoch(device, 0)
        views_diff = max(
            (g.float().cpu() - c).abs().max().item()
            for gb, cb in zip(device, cpu)
            for g, c in zip(gb["crops"], cb["crops"])
        )
    return {"cpu_decode_ms_per_batch": cpu_ms, "nvjpeg_ms_per_batch": gpu_ms, "cpu_over_nvjpeg": cpu_ms / gpu_ms,
            "max_pixel_diff": pixel_diff, "views_max_abs_diff": views_diff, "batch": batch}  # fmt: skip


# nvjpeg and libjpeg-turbo may round a pixel differently (a grey level or two); the views then
# differ by about that much / 255 after normalisation by a std near 0.25
DECODE_PIXEL_LIMIT, DECODE_VIEWS_LIMIT = 8, 0.15


def _decode_ok(decode: dict) -> bool:
    return (
        decode["max_pixel_diff"] <= DECODE_PIXEL_LIMIT and decode["views_max_abs_diff"] < DECODE_VIEWS_LIMIT
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--only", choices=["engine", "views", "decode"], default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU paths are covered by the tests)")
        return
    if args.only == "views":
        views = views_check()
        print("views", views)
        print("PASS" if views["max_abs_diff"] < 1e-3 else "FAIL")
        return
    if args.only == "decode":
        decode = decode_check()
        print("decode", decode)
        print("PASS" if _decode_ok(decode) else "FAIL")
        return
    world = torch.cuda.device_count()
    summary = run_on_ranks(worker, world, backend="nccl")[0]
    if args.only is None:
        summary["views"] = views_check()
        summary["decode"] = decode_check()
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
    views_ok = "views" not in summary or summary["views"]["max_abs_diff"] < 1e-3
    decode_ok = "decode" not in summary or _decode_ok(summary["decode"])
    print("PASS" if fp32_ok and mixed_ok and views_ok and decode_ok else "FAIL")


if __name__ == "__main__":
    main()
