"""Prints ELPV test top-1 with few labels and all of them: fine-tuned from the SSL trunk against from scratch.

Does pretraining on the unlabelled cells help when labels are few? For one pretraining seed P
(``config=pretrain/simclr_regnet_elpv``, ``SEED_VALUE`` = ``DATA.SPLIT_SEED`` = P, the shipped
recipe on the split's 1,968 training cells, no labels), and for every label seed s (the stratified
subset, ``DATA.TRAIN.LABEL_SUBSET_SEED`` = s, and the fine-tune's own ``SEED_VALUE`` = s: head
initialisation, data order, views), through the normal launcher on 2 CPU ranks:

1. ``config=benchmark/finetune_elpv`` from the SSL trunk (``PARAMS_FILE`` = the pretraining);
2. the same fine-tune from a random trunk (no ``PARAMS_FILE``: supervised from scratch, the same
   trunk, epochs, lr grid and augmentations: the control);
3. with ``--linear``, ``config=benchmark/linear_eval_elpv`` on the SSL trunk with the same labels;
4. with ``--controls``, the controls that learn from the same labelled cells: the pixel RBF-SVM
   (64 px, standardised, C among 1 / 10 / 100 by 3-fold cross-validation on the subset, C = 1
   where a class has fewer than 3 labelled cells) and ``benchmark/linear_eval_elpv`` on a random
   trunk. ``--scratch KEY=VALUE ...`` gives the from-scratch fine-tune its own knobs (its lr grid
   and epochs), so that it is chosen to learn rather than borrowed from the SSL trunk's.

``--fraction`` is ``DATA.TRAIN.LABEL_FRACTION`` (1.0: every label; the subset seed then changes
nothing but the fine-tune's seed). Prints one row per label seed (4 and 2 classes, each run's lr
and epochs as the held-out 20% picked them, the paired difference SSL - scratch on 4 classes), the
mean +- standard error over the label seeds, and the standard error of the mean paired difference
(std of the differences / sqrt(n)): the quality bar is a mean difference above twice it.

Runs live in ``--out/pretrain_<P>/`` and ``--out/f<fraction>_s<s>_<trunk>/`` with their logs; a
run whose ``metrics.json`` is there is read, not run again.

    OMP_NUM_THREADS=1 python dev/studies/elpv_fractions.py --fraction 0.1 --label-seeds 0 1 2 3 4 --linear
    OMP_NUM_THREADS=1 python dev/studies/elpv_fractions.py --fraction 1.0 --label-seeds 0 1
    OMP_NUM_THREADS=1 python dev/studies/elpv_fractions.py --fraction 0.1 --linear --controls \
        --scratch config.BENCHMARK.FINETUNE.LRS=[0.1,0.3] config.OPTIMIZER.num_epochs=60
    python dev/studies/elpv_fractions.py --pretrain-seed 11 --fraction 0.1 --label-seeds 21 22 --out /tmp/held_out
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev" / "recipes"))

from demo_pretrain_then_eval import run  # noqa: E402
from elpv_baselines import load_pixels, scores  # noqa: E402
from elpv_seeds import overrides  # noqa: E402

PRETRAIN, FINETUNE, LINEAR = (
    "pretrain/simclr_regnet_elpv",
    "benchmark/finetune_elpv",
    "benchmark/linear_eval_elpv",
)


def pretrained(args) -> Path:
    """The SSL trunk of ``--pretrain-seed`` (trained once, then read)."""
    folder = args.out / f"pretrain_{args.pretrain_seed}"
    done = args.out / f"pretrain_{args.pretrain_seed}.json"
    if not done.exists():
        argv = [f"config={PRETRAIN}", f"config.CHECKPOINT.DIR={folder}", *split(args), *args.pretrain]
        timings = {}
        cpu = run("pretrain", argv, timings, args.out / f"pretrain_{args.pretrain_seed}.log")
        done.write_text(json.dumps({"wall_s": timings["pretrain"], "cpu_per_rank_s": cpu / 2}))
    return folder


def split(args) -> list:
    return [f"config.SEED_VALUE={args.pretrain_seed}", f"config.DATA.SPLIT_SEED={args.pretrain_seed}"]


def evaluate(args, config: str, name: str, seed: int, weights: str, extra=()) -> dict:
    """One evaluation run (read if done); returns its metrics.json's ``picked`` entry and epochs."""
    folder = args.out / f"f{args.fraction:g}_s{seed}_{name}"
    if not (folder / "metrics.json").exists():
        argv = [
            f"config={config}",
            f"config.CHECKPOINT.DIR={folder}",
            f"config.DATA.SPLIT_SEED={args.pretrain_seed}",
            f"config.SEED_VALUE={seed}",
            f"config.DATA.TRAIN.LABEL_FRACTION={args.fraction}",
            f"config.DATA.TRAIN.LABEL_SUBSET_SEED={seed}",
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={weights}",
            *args.eval,
            *extra,
        ]
        run(f"{name}, label seed {seed}", argv, {}, folder.parent / f"{folder.name}.log")
    metrics = json.loads((folder / "metrics.json").read_text())
    return {**metrics["picked"], "epochs": metrics.get("epochs")}


def pixel_svm(args, seed: int) -> dict:
    """The pixel RBF-SVM on the label seed's subset of the split's training cells (the cells the
    evaluations use: ``label_subset`` over the ``elpv`` source's TRAIN positions), scored on every
    test cell; C by 3-fold cross-validation where every class has 3 labelled cells, else C = 1."""
    import numpy as np

    from vistrain.benchmarks.label_fraction import label_subset
    from vistrain.data.elpv import DEFECTIVE_FROM, package_folder, read_labels, stratified_split

    paths, classes, types = read_labels(package_folder())
    train, test = stratified_split(list(zip(classes.tolist(), types.tolist())), args.pretrain_seed)
    kept = [train[p] for p in label_subset(range(len(train)), classes[train], args.fraction, seed)]
    pixels = load_pixels(paths, 64)
    out = {}
    for key, labels in (("top1", classes), ("top1_2class", (classes >= DEFECTIVE_FROM).astype(np.int64))):
        tune = np.bincount(labels[kept]).min() >= 3
        result = scores(pixels[kept], labels[kept], pixels[test], labels[test], tune, {}, ["pixel RBF-SVM"])
        out[key], out["majority" + key[4:]] = result["pixel RBF-SVM"], result["majority"]
    return out


def mean_se(values) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {se:.2f}"


def knobs(picked: dict) -> str:
    return "/".join(f"{picked[k]:g}" for k in ("lr", "epochs") if picked.get(k) is not None)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pretrain-seed", type=int, default=0)
    parser.add_argument("--label-seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--linear", action="store_true", help="also the linear probe on the SSL trunk")
    parser.add_argument("--controls", action="store_true", help="the pixel SVM and the random-trunk probe")
    parser.add_argument(
        "--scratch", nargs="*", default=[], help="KEY=VALUE overrides of the scratch fine-tune"
    )
    parser.add_argument("--out", default="./checkpoints/elpv_fractions")
    parser.add_argument("--pretrain", nargs="*", default=[], help="KEY=VALUE overrides of the pretraining")
    parser.add_argument("--eval", nargs="*", default=[], help="KEY=VALUE overrides of every evaluation")
    args = parser.parse_args()
    args.out = Path(args.out).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.pretrain, args.eval, args.scratch = (
        overrides(args.pretrain),
        overrides(args.eval),
        overrides(args.scratch),
    )
    trunk = str(pretrained(args))
    rows = []
    for seed in args.label_seeds:
        row = {"ssl": evaluate(args, FINETUNE, "ssl", seed, trunk)}
        scratch = "scratch_own" if args.scratch else "scratch"  # its own knobs: its own folder
        row["scratch"] = evaluate(args, FINETUNE, scratch, seed, "", args.scratch)
        if args.linear:
            row["linear"] = evaluate(args, LINEAR, "linear", seed, trunk)
        if args.controls:
            row["random probe"] = evaluate(args, LINEAR, "random_linear", seed, "")
            row["pixel SVM"] = pixel_svm(args, seed)
        rows.append((seed, row))
    print_table(args, rows)
    (args.out / f"summary_f{args.fraction:g}.json").write_text(json.dumps(rows, indent=1))
    return 0


def print_table(args, rows) -> None:
    runs = list(rows[0][1])
    print(f"\nELPV, {args.fraction:.0%} of the labels, pretraining seed {args.pretrain_seed}: test top-1 (%)")
    head = " | ".join(f"{r} 4 | {r} 2" for r in runs)
    print(f"| label seed | {head} | SSL - scratch, 4 | lr/epochs ({', '.join(runs)}) |")
    print("|---" * (2 * len(runs) + 3) + "|")
    for seed, row in rows:
        cells = " | ".join(f"{row[r]['top1']:.2f} | {row[r]['top1_2class']:.2f}" for r in runs)
        diff = row["ssl"]["top1"] - row["scratch"]["top1"]
        print(f"| {seed} | {cells} | {diff:+.2f} | {', '.join(knobs(row[r]) for r in runs)} |")
    cells = " | ".join(
        f"{mean_se([row[r]['top1'] for _, row in rows])} | {mean_se([row[r]['top1_2class'] for _, row in rows])}"
        for r in runs
    )
    diffs = [row["ssl"]["top1"] - row["scratch"]["top1"] for _, row in rows]
    print(f"| mean ± s.e. | {cells} | {mean_se(diffs)} | |")
    if "pixel SVM" in runs:
        svm = rows[0][1]["pixel SVM"]
        print(
            f"majority class of the test cells: {svm['majority']:.2f} (4 classes), {svm['majority_2class']:.2f} (2)"
        )
    if len(diffs) > 1:
        se = statistics.stdev(diffs) / len(diffs) ** 0.5
        verdict = "above" if statistics.fmean(diffs) > 2 * se else "not above"
        print(f"mean difference {statistics.fmean(diffs):+.2f}, twice its s.e. {2 * se:.2f}: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
