"""Prints img/s, data share and peak memory of the ELPV recipe per crop size and loader workers.

What an image recipe costs on this machine: img/s and data share of the ELPV recipe by crop size.

Runs ``config=pretrain/simclr_regnet_elpv`` (2 CPU ranks) with two views per cell (its four small
crops left out, as the recipe had before multi-crop) for two short epochs (``--images`` cells)
at each of ``--sizes`` (crop side = DECODE_SIZE, so no resize is left for the views but the crop's),
with ``--workers`` DataLoader workers per rank each, and prints the second epoch's throughput (the
mean of metrics.jsonl's ``images_per_sec``; the first holds the start and decodes every cell once)
and ``data_share`` (the part of the step spent waiting for data).

    OMP_NUM_THREADS=1 python dev/bench/bench_image_sizes.py                       # 64, 112, 224 px; 0 and 1 workers
    python dev/bench/bench_image_sizes.py --sizes 96 --workers 0 1 2 --images 1024
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "recipes"))

from demo_pretrain_then_eval import run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 112, 224])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--images", type=int, default=512, help="DATA_LIMIT: cells per epoch")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for size in args.sizes:
            for workers in args.workers:
                run_dir = Path(scratch) / f"{size}_{workers}"
                argv = [
                    "config=pretrain/simclr_regnet_elpv",
                    f"config.CHECKPOINT.DIR={run_dir}",
                    f"config.DATA.TRAIN.DECODE_SIZE={size}",
                    "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2]",  # two views of one size, no small crops
                    f"config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[{size}]",
                    "config.DATA.TRAIN.TRANSFORMS.CROP_SCALES=[[0.6,1.0]]",
                    f"config.DATA.TRAIN.DATA_LIMIT={args.images}",
                    f"config.DATA.NUM_DATALOADER_WORKERS={workers}",
                    "config.OPTIMIZER.num_epochs=2",
                    "config.LOG_FREQUENCY=2",
                ]
                timings = {}
                run(f"{size} px, {workers} workers", argv, timings, run_dir / "out.log")
                lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                lines = [
                    x for x in lines if x["epoch"] == 1 and "loss" in x
                ]  # the second epoch: decoded, warm
                speed = statistics.fmean(x["images_per_sec"] for x in lines)
                share = statistics.fmean(x["data_share"] for x in lines)
                peak = max(x["peak_mem_mib"] for x in lines)
                rows.append((size, workers, speed, share, peak, timings[f"{size} px, {workers} workers"]))
    print("\n| crop px | workers per rank | img/s (2 ranks) | data share | peak MiB per rank | wall s |")
    print("|---|---|---|---|---|---|")
    for size, workers, speed, share, peak, wall in rows:
        print(f"| {size} | {workers} | {speed:.1f} | {share:.0%} | {peak:.0f} | {wall:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
