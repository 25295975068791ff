"""Prints what the online linear probe adds to a monitor pass: the seconds of its fit
(MONITOR.PROBE_EPOCHS epochs over the kNN bank, as every rank runs it) and of its test scoring, one
process, one thread, for the quick start's bank (1,437 digits x its 64-wide avgpool, 10 classes,
360 test images) and larger ones.

    python dev/bench/bench_online_probe.py [--epochs 20]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vistrain.methods import load_config
from vistrain.training.online_probe import OnlineProbe

SHAPES = [  # (bank images, D, classes, test images)
    (1437, 64, 10, 360),  # the quick start
    (1437, 768, 10, 360),  # its s2@4+s3
    (12_811, 2048, 1000, 5000),  # 1% of ImageNet, a ResNet-50's avgpool
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(["config=regnet_fsdp", f"config.MONITOR.PROBE_EPOCHS={args.epochs}"])
    for images, dim, classes, tests in SHAPES:
        probe = OnlineProbe(classes, cfg, torch.device("cpu"))
        bank, labels = torch.randn(images, dim), torch.randint(0, classes, (images,))
        test, test_labels = torch.randn(tests, dim), torch.randint(0, classes, (tests,))
        start = time.perf_counter()
        probe.fit(bank, labels)
        fitted = time.perf_counter()
        probe.top1(test, test_labels, torch.arange(tests), bank)
        scored = time.perf_counter()
        print(
            f"bank {images} x {dim} -> {classes} classes, {args.epochs} epochs: fit {fitted - start:.2f} s, "
            f"{tests} test images {scored - fitted:.3f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
