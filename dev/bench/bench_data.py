"""Prints the data pipeline's images/s alone (read, multi-crop augment, collate), without a model.

Images per second of the data pipeline alone (read + multi-crop augment + collate), no model.

Compare with the trainer's images/s: if the pipeline is not clearly faster, training is input-bound
and needs more DATA.NUM_DATALOADER_WORKERS (or cheaper augmentations).

    python dev/bench/bench_data.py                          # demo_digits, 2x32px + 6x16px crops, 2 workers
    python dev/bench/bench_data.py --workers 4 --batch-size 128
    python dev/bench/bench_data.py --config configs/test/swav_tiny.yaml   # DATA.TRAIN of a recipe instead
"""

import argparse
import time

import torch

from vistrain.data import build_loader, set_epoch
from vistrain.methods import get_defaults


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default="", help="YAML recipe whose DATA section is used (default: demo_digits)"
    )
    parser.add_argument("--workers", type=int, default=2, help="DATA.NUM_DATALOADER_WORKERS")
    parser.add_argument("--batch-size", type=int, default=64, help="DATA.TRAIN.BATCHSIZE_PER_REPLICA")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up batch)")
    parser.add_argument("--cache-dir", default="", help="DATA.CACHE_DIR (default ~/.cache/vistrain)")
    return parser.parse_args()


def demo_digits_data_cfg(args):
    """DATA of a SwAV-style multi-crop run on demo_digits: 2 x 32px (scale .14-1) + 6 x 16px (.05-.14)."""
    cfg = get_defaults()
    if args.config:
        cfg.merge_from_file(args.config)
    else:
        train = cfg.DATA.TRAIN
        train.DATA_SOURCES, train.DATA_PATHS, train.SPLIT = ["demo_digits"], [""], "train"
        train.TRANSFORMS.NUM_CROPS = [2, 6]
        train.TRANSFORMS.SIZE_CROPS = [32, 16]
        train.TRANSFORMS.CROP_SCALES = [[0.14, 1.0], [0.05, 0.14]]
    cfg.DATA.NUM_DATALOADER_WORKERS = args.workers
    cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA = args.batch_size
    cfg.DATA.CACHE_DIR = args.cache_dir or cfg.DATA.CACHE_DIR
    return cfg.DATA


def main():
    args = parse_args()
    data_cfg = demo_digits_data_cfg(args)
    loader = build_loader(data_cfg, "TRAIN", seed=0, device=torch.device("cpu"))
    crops = list(zip(data_cfg.TRAIN.TRANSFORMS.NUM_CROPS, data_cfg.TRAIN.TRANSFORMS.SIZE_CROPS))
    print(
        f"sources {list(data_cfg.TRAIN.DATA_SOURCES)}: {len(loader.dataset)} images, crops (count, side) {crops}, "
        f"batch {args.batch_size}, workers {args.workers}, {len(loader)} iterations/epoch"
    )
    set_epoch(loader, 0)
    iterator = iter(loader)
    next(iterator)  # worker start-up is not part of the steady-state rate
    images, start = 0, time.perf_counter()
    for batch in iterator:
        images += batch["label"].numel()
    for epoch in range(1, args.epochs):
        set_epoch(loader, epoch)
        for batch in loader:
            images += batch["label"].numel()
    seconds = time.perf_counter() - start
    views = images * sum(count for count, _ in crops)
    print(
        f"{images / seconds:.1f} images/s ({views / seconds:.1f} views/s) over {images} images in {seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
