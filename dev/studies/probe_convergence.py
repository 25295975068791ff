"""Prints the linear probe's val top-1 per (epochs, lr) on one trunk: does the probe converge?

Does the linear probe converge? Val top-1 of the probe's head per (epochs, lr) on one trunk.

The shipped linear evaluation (``configs/benchmark/linear_eval_regnet.yaml``) trains
``BatchNorm1d(affine=False) -> Linear`` heads on frozen features with SGD + nesterov, weight decay
and a cosine schedule, and picks the lr on TRAIN. Whether that choice can matter depends on how far
the heads are from their optimum: when the val top-1 still moves with the lr, the chosen lr decides
the reported number. This script rebuilds the probe in one process on the frozen features of a run
(the centre crops of the bundled digits, stages pooled to 2x2 as the benchmark does; batch 128 =
2 ranks x 64) and prints its val top-1 for every (epochs, lr), plus a scikit-learn logistic
regression per C on the same standardised features as a converged reference.

    python dev/studies/probe_convergence.py ./checkpoints/swav_regnet_demo
    python dev/studies/probe_convergence.py ./checkpoints/regnet_fsdp --feature s3 --epochs 30 100
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dev" / "recipes"))

import swav_diagnostics  # noqa: E402

from vistrain.benchmarks.linear_eval import LinearHeads  # noqa: E402
from vistrain.data import build_loader  # noqa: E402


def frozen_features(run_dir: str):
    """{"train": {feature: (N, D), "label": (N,)}, "val": ...} of a run's last checkpoint."""
    model, cfg = swav_diagnostics.eval_model(*swav_diagnostics.load_run(run_dir))
    model.head = None
    cpu = torch.device("cpu")
    return {
        split: swav_diagnostics.feature_pass(
            model, build_loader(cfg.DATA, key, cfg.SEED_VALUE, cpu, rank=0, world_size=1)
        )
        for split, key in (("train", "TRAIN"), ("val", "TEST"))
    }


def probe_top1(train, val, lr: float, epochs: int, weight_decay: float, batch: int, seed: int) -> float:
    """Val top-1 (%) of one probe head: SGD nesterov (momentum 0.9), cosine lr from ``lr`` to 0."""
    torch.manual_seed(seed)
    (x, y), (xv, yv) = train, val
    head = LinearHeads({"f": x.shape[1]}, int(y.max()) + 1)
    opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    steps_per_epoch = x.shape[0] // batch  # drop_last, as the training loader
    total, step = epochs * steps_per_epoch, 0
    head.train()
    for _ in range(epochs):
        order = torch.randperm(x.shape[0])
        for i in range(steps_per_epoch):
            rows = order[i * batch : (i + 1) * batch]
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            loss = F.cross_entropy(head({"f": x[rows]})["f"], y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    head.eval()
    with torch.no_grad():
        return 100.0 * (head({"f": xv})["f"].argmax(dim=1) == yv).double().mean().item()


def logistic_top1(train, val, c: float) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    model = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=3000))
    model.fit(train[0].numpy(), train[1].numpy())
    return 100.0 * model.score(val[0].numpy(), val[1].numpy())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", help="a pretraining run folder (holds config.yaml)")
    parser.add_argument("--feature", default="s2", choices=swav_diagnostics.FEATURES)
    parser.add_argument("--epochs", type=int, nargs="+", default=[30, 100, 300])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0])
    parser.add_argument("--weight-decay", type=float, default=5e-4, help="the shipped probe's")
    parser.add_argument("--batch", type=int, default=128, help="global batch: 2 ranks x 64")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    feats = frozen_features(str(args.run_dir))
    train = (feats["train"][args.feature], feats["train"]["label"])
    val = (feats["val"][args.feature], feats["val"]["label"])
    print(f"{args.run_dir}, {args.feature}: probe val top-1 (%) by epochs and lr")
    print("| epochs | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " |")
    print("|---" * (len(args.lrs) + 1) + "|")
    for epochs in args.epochs:
        row = [
            probe_top1(train, val, lr, epochs, args.weight_decay, args.batch, args.seed) for lr in args.lrs
        ]
        print(f"| {epochs} | " + " | ".join(f"{top1:.2f}" for top1 in row) + " |", flush=True)
    cs = [0.01, 0.1, 1.0, 10.0]
    print(
        "logistic regression (standardised, converged): "
        + ", ".join(f"C {c:g} {logistic_top1(train, val, c):.2f}" for c in cs)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
