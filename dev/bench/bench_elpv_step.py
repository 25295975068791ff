"""Prints img/s and data share of ELPV recipe variants, and sync BatchNorm's time against torch's.

Where the ELPV recipe's training step goes: short runs of ``config=pretrain/simclr_regnet_elpv``
(2 CPU ranks) with one setting changed at a time, and the synchronised BatchNorm against torch's.

1. Runs: each variant trains ``--epochs`` epochs on ``--images`` cells; the first epoch (start-up,
   every cell decoded once) is dropped; img/s and data share are the medians of the rest of
   metrics.jsonl. The variants run ``--rounds`` times in rotated order (the machine is noisy: read
   the ratios to the recipe, measured side by side, more than the values).

   recipe       as shipped: batches in channels_last memory, one loader worker per rank, sync BN
   contiguous   MODEL.CHANNELS_LAST=False
   no workers   DATA.NUM_DATALOADER_WORKERS=0
   local BN     MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=False (what synchronising costs)

2. BatchNorm, one process, one thread: forward + backward of the CPU sync BN's autograd function
   (its all-reduces are no-ops in one process) and of ``F.batch_norm`` in training mode, on the
   recipe's BatchNorm shapes at its 96 px crops (batch 128 = 64 cells x 2 views per rank; the
   four 48 px crops of its multi-crop are not timed here).

    OMP_NUM_THREADS=1 python dev/bench/bench_elpv_step.py
    python dev/bench/bench_elpv_step.py --skip-runs          # the BatchNorm part only (seconds)
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "recipes"))
sys.path.insert(0, str(REPO))

from demo_pretrain_then_eval import run  # noqa: E402

from vistrain.distributed.sync_batchnorm import _SyncBatchNormFn  # noqa: E402
from vistrain.methods import build_model, load_config  # noqa: E402

VARIANTS = {
    "recipe": [],
    "contiguous": ["config.MODEL.CHANNELS_LAST=False"],
    "no workers": ["config.DATA.NUM_DATALOADER_WORKERS=0"],
    "local BN": ["config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=False"],
}


def measure_runs(args) -> dict:
    speeds = {name: [] for name in VARIANTS}
    shares = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                run_dir = Path(scratch) / f"{name.replace(' ', '_')}_{round_index}"
                argv = [
                    "config=pretrain/simclr_regnet_elpv",
                    f"config.CHECKPOINT.DIR={run_dir}",
                    f"config.DATA.TRAIN.DATA_LIMIT={args.images}",
                    f"config.OPTIMIZER.num_epochs={args.epochs}",
                    "config.LOG_FREQUENCY=5",
                    *VARIANTS[name],
                ]
                run(name, argv, {}, run_dir / "out.log")
                lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                warm = [x for x in lines if x["epoch"] >= 1 and "loss" in x]  # no monitor records
                speeds[name].append(statistics.median(x["images_per_sec"] for x in warm))
                shares[name].append(statistics.median(x["data_share"] for x in warm))
    return {name: (statistics.median(speeds[name]), statistics.median(shares[name])) for name in names}


def _seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batchnorm_shapes() -> Counter:
    """{(C, H, W): how many of the recipe's BatchNorms see it} for one 96 px crop."""
    model = build_model(load_config(["config=pretrain/simclr_regnet_elpv"]).MODEL)
    shapes = Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.register_forward_hook(lambda m, inputs, out: shapes.update([tuple(inputs[0].shape[1:])]))
    with torch.no_grad():
        model(torch.randn(2, 3, 96, 96))
    return shapes


def _time_batchnorms(shape, repeats: int):
    """(sync BN fwd+bwd s, torch's fwd+bwd s) on a channels_last input of ``shape`` (N, C, H, W)."""
    x = torch.randn(*shape).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    channels = shape[1]
    weight = torch.ones(channels, requires_grad=True)
    bias = torch.zeros(channels, requires_grad=True)
    dy = torch.randn_like(x)
    mean, var = torch.zeros(channels), torch.ones(channels)

    def synced():
        _SyncBatchNormFn.apply(x, weight, bias, mean, var, 1e-5, 0.1, None).backward(dy)

    def native():
        F.batch_norm(x, mean, var, weight, bias, True).backward(dy)

    return _seconds(synced, repeats), _seconds(native, repeats)


def measure_batchnorm(batch: int, repeats: int):
    torch.set_num_threads(1)
    return [
        (shape, count, *_time_batchnorms((batch, *shape), repeats))
        for shape, count in sorted(batchnorm_shapes().items())
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=1280, help="DATA_LIMIT: cells per epoch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-runs", action="store_true")
    args = parser.parse_args()
    if not args.skip_runs:
        results = measure_runs(args)
        base = results["recipe"][0]
        print("\n| variant | img/s (2 ranks) | / recipe | data share |")
        print("|---|---|---|---|")
        for name, (speed, share) in results.items():
            print(f"| {name} | {speed:.1f} | {speed / base:.2f} | {share:.1%} |")
    print(
        "\n| BatchNorm input (128 x C x H x W, channels_last) | layers | sync BN fwd+bwd ms | torch's ms | ratio |"
    )
    print("|---|---|---|---|---|")
    rows = measure_batchnorm(128, 10)
    for shape, count, synced, native in rows:
        print(
            f"| {' x '.join(map(str, shape))} | {count} | {synced * 1e3:.2f} | {native * 1e3:.2f} | {synced / native:.2f} |"
        )
    synced, native = (sum(row[1] * row[i] for row in rows) for i in (2, 3))
    print(
        f"| per step (every layer) | {sum(row[1] for row in rows)} | {synced * 1e3:.1f} | {native * 1e3:.1f} | {synced / native:.2f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
