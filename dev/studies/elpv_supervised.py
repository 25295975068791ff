"""Prints the ELPV probe's top-1 on the recipe's trunk trained with labels, and that classifier's.

How far could *any* pretraining of the ELPV recipe's trunk lift the linear probe? Train that trunk
with the labels instead, in less than the recipe's time, and give it to the same probe.

The self-supervised recipe is held to "3 points over the random trunk on 4 classes". This script
measures the ceiling of that margin for the recipe's trunk, views and input size: the trunk of
``pretrain/simclr_regnet_elpv`` (same architecture, same initialisation seed) trained with
cross-entropy on the 4-class labels of the split's 1,968 training cells (one view per cell per
epoch: a 96 px crop of 0.6-1 of the cell with the recipe's flips, quarter turns, brightness and
contrast jitter and blur; a linear classifier on the trunk's average-pooled 128 features; SGD with
Nesterov momentum, cosine lr), in one process. Then the trunk (its classifier dropped, the
pretraining head left at its initialisation: the probe skips ``head.``) is evaluated by
``benchmark/linear_eval_elpv`` exactly as a pretrained trunk is (``dev/recipes/elpv_seeds.py``), and the
supervised classifier's own test top-1 (center view, then the mean of the 8 symmetries' softmax)
is printed beside it. The test cells are read only once the training is over.

    OMP_NUM_THREADS=2 python dev/studies/elpv_supervised.py --seed 3 --out /tmp/elpv_sup
    OMP_NUM_THREADS=2 python dev/studies/elpv_supervised.py --seed 11 --split-seed 7 --out /tmp/elpv_sup
"""

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dev" / "recipes"))

from elpv_seeds import overrides  # noqa: E402

from vistrain.benchmarks.common import FEATURE_VIEWS, view_of  # noqa: E402
from vistrain.data.datasets import build_dataset  # noqa: E402
from vistrain.methods import build_model, load_config  # noqa: E402

DIHEDRAL = FEATURE_VIEWS["dihedral"]  # (quarter turns, mirror) of the 8 symmetries
ONE_VIEW = [  # the recipe's large crop, one per cell and epoch
    "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[1]",
    "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[96]",
    "config.DATA.TRAIN.TRANSFORMS.CROP_SCALES=[[0.6,1.0]]",
]


def batches(num_samples: int, batch_size: int, epoch: int, seed: int):
    """Lists of (index, epoch) keys: a fresh permutation per epoch, the last partial batch dropped."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    for start in range(0, num_samples - batch_size + 1, batch_size):
        yield [(int(i), epoch) for i in order[start : start + batch_size]]


def collate(data, keys):
    """(views (B, 3, h, w), labels (B,)) of the samples ``keys`` of ``data``, one view each."""
    batch = data.collate([data[k] for k in keys])
    return batch["crops"][0], batch["label"]


class Classifier(nn.Module):
    """The SSL model's trunk -> average-pooled features (N, C) -> logits (N, 4)."""

    def __init__(self, ssl_model: nn.Module, num_classes: int = 4):
        super().__init__()
        self.ssl_model = ssl_model
        self.fc = nn.Linear(ssl_model.trunk.feature_dims["avgpool"], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ssl_model.trunk(x)["avgpool"])


@torch.no_grad()
def test_top1(model: nn.Module, cfg) -> dict:
    """The supervised classifier's own top-1 on the split's test cells (4 and 2 classes)."""
    data = build_dataset(cfg.DATA.TEST, seed=cfg.SEED_VALUE, key="DATA.TEST", split_seed=cfg.DATA.SPLIT_SEED)
    model.eval()
    center, averaged, labels = [], [], []
    for start in range(0, len(data), 128):
        images, target = collate(data, range(start, min(start + 128, len(data))))
        center.append(model(images).softmax(1))
        averaged.append(torch.stack([model(view_of(images, *v)).softmax(1) for v in DIHEDRAL]).mean(0))
        labels.append(target)
    labels = torch.cat(labels)
    out = {}
    for name, probs in (("center", torch.cat(center)), ("dihedral", torch.cat(averaged))):
        defective = probs[:, 2:].sum(1) > probs[:, :2].sum(1)
        out[name] = {
            "top1": 100.0 * (probs.argmax(1) == labels).float().mean().item(),
            "top1_2class": 100.0 * (defective == (labels >= 2)).float().mean().item(),
        }
    return out


def train(args, cfg) -> dict:
    torch.manual_seed(cfg.SEED_VALUE)  # the recipe's trunk initialisation for this seed
    model = Classifier(build_model(cfg.MODEL)).to(memory_format=torch.channels_last)
    data = build_dataset(cfg.DATA.TRAIN, seed=cfg.SEED_VALUE, split_seed=cfg.DATA.SPLIT_SEED)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, momentum=0.9, nesterov=True,
    )  # fmt: skip
    steps_per_epoch = len(data) // args.batch_size
    total, warmup = args.epochs * steps_per_epoch, 2 * steps_per_epoch
    start, step = time.perf_counter(), 0
    for epoch in range(args.epochs):
        model.train()
        loss_sum = correct = seen = 0
        for keys in batches(len(data), args.batch_size, epoch, cfg.SEED_VALUE):
            images, labels = collate(data, keys)
            scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / total))
            for group in optimizer.param_groups:
                group["lr"] = args.lr * scale
            logits = model(images.contiguous(memory_format=torch.channels_last))
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            loss_sum += loss.item() * len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            seen += len(labels)
        elapsed = time.perf_counter() - start
        print(
            f"epoch {epoch + 1}/{args.epochs}  loss {loss_sum / seen:.4f}  train top-1 "
            f"{100.0 * correct / seen:.1f}  {(epoch + 1) * seen / elapsed:.0f} img/s  {elapsed / 60:.1f} min",
            flush=True,
        )
    return {"model": model, "train_s": time.perf_counter() - start}


def probe(model: Classifier, seeds, out: Path) -> dict:
    """Save the trunk (as a checkpoint of the SSL model) and run ``benchmark/linear_eval_elpv`` on
    it through the launcher, as ``dev/recipes/elpv_seeds.py`` does; returns metrics.json's ``picked``."""
    weights = out / "trunk.pt"
    state = {k: v.contiguous() for k, v in model.ssl_model.state_dict().items()}
    torch.save({"model": state}, weights)
    eval_dir = out / "eval_supervised"
    argv = [
        sys.executable, str(REPO / "tools" / "run_distributed.py"), "config=benchmark/linear_eval_elpv", *seeds,
        f"config.CHECKPOINT.DIR={eval_dir}", f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={weights}",
    ]  # fmt: skip
    with open(out / "eval_supervised.log", "w") as log:
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads((eval_dir / "metrics.json").read_text())["picked"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--split-seed", type=int, default=None, help="DATA.SPLIT_SEED (default: the seed)")
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--out", default="./checkpoints/elpv_supervised")
    parser.add_argument(
        "--views",
        nargs="*",
        default=[],
        help="view overrides, e.g. DATA.TRAIN.TRANSFORMS.COLOR_DISTORTION=0.0",
    )
    args = parser.parse_args()
    split_seed = args.seed if args.split_seed is None else args.split_seed
    out = Path(args.out).resolve() / f"seed_{args.seed}_split_{split_seed}"
    out.mkdir(parents=True, exist_ok=True)
    seeds = [f"config.SEED_VALUE={args.seed}", f"config.DATA.SPLIT_SEED={split_seed}"]
    views = overrides(args.views)
    cfg = load_config(["config=pretrain/simclr_regnet_elpv", *seeds, *ONE_VIEW, *views])
    trained = train(args, cfg)
    model = trained["model"]
    own = test_top1(model, cfg)
    picked = probe(model, seeds, out)
    record = {
        "seed": args.seed, "split_seed": split_seed, "epochs": args.epochs, "train_min": trained["train_s"] / 60,
        "lr": args.lr, "views": views,
        "classifier": own, "probe": picked,
    }  # fmt: skip
    (out / "result.json").write_text(json.dumps(record, indent=1))
    print(
        f"seed {args.seed} split {split_seed}: {args.epochs} supervised epochs in {record['train_min']:.1f} min; "
        f"its classifier {own['center']['top1']:.2f} / {own['center']['top1_2class']:.2f} (center), "
        f"{own['dihedral']['top1']:.2f} / {own['dihedral']['top1_2class']:.2f} (8 views); the probe on its trunk "
        f"{picked['top1']:.2f} / {picked['top1_2class']:.2f} ({picked['feature']}, cross-validated "
        f"{picked['holdout_top1']:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
