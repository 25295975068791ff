"""Prints a shipped recipe's linear-probe top-1 per seed and over seeds, against pixel baselines.

Does a shipped recipe earn its claim on every seed? Pretrain, then linear-evaluate, over N seeds.

For every seed (``config.SEED_VALUE``: the trunk's initialisation, the data order and the views of
pretraining; the folds and head initialisation of the probe), through the normal launcher:

1. pretrain with the method's shipped recipe (SimCLR: ``config=regnet_fsdp``, the quick start;
   SwAV: ``config=pretrain/swav_regnet_demo``), sharded over 2 CPU ranks;
2. ``config=benchmark/linear_eval_regnet`` on the result (linear heads on every
   ``BENCHMARK.FEATURES`` entry, each head's lr chosen by cross-validation on the TRAIN digits).

Then prints one row per seed, the mean +- standard deviation over the seeds (sample std, n - 1) and
the mean +- standard error (that std / sqrt(n)):
val top-1 of every evaluated feature, that of the feature a user would pick without looking at val
(``chosen``: the highest top-1 of the probe's cross-validation on TRAIN; ties go to the first
listed), the margin of the chosen feature over the raw-pixel
logistic regression and over the RBF-SVM (``dev/recipes/demo_pretrain_then_eval.py``'s baselines, chosen by
5-fold cross-validation on TRAIN), and the time taken (wall; CPU of all processes per rank in
brackets). The claim of the README: every seed's chosen feature above the pixel logistic
regression, and the mean margin at least ``--min-mean-margin`` (SimCLR 1.0, SwAV 0.5 points);
``--check`` exits 1 when it does not hold.

Each seed's runs live in ``--out/seed_<N>/`` with their logs (``pretrain.log``, ``linear_eval.log``);
a seed whose ``result.json`` is there is not run again, an interrupted one resumes from its last
checkpoint (its times, marked ``*``, are those of the last part), ``--overwrite`` starts from scratch.
``summary.json`` holds every number printed. ``--reuse-pretraining EARLIER_OUT`` evaluates the
pretrained trunks of an earlier ``--out`` again (after a change of the linear evaluation).

    python dev/recipes/recipe_seeds.py                                      # SimCLR quick start, seeds 0-4
    python dev/recipes/recipe_seeds.py --method SwAV --seeds 5 6 7 --check # held-out seeds
    python dev/recipes/recipe_seeds.py --method DINO-ViT --seeds 5 6 7 --random-control  # + untrained trunks
    python dev/recipes/recipe_seeds.py --out /tmp/t01 --pretrain config.LOSS.simclr_loss.temperature=0.1
    python dev/recipes/recipe_seeds.py --out /tmp/zero3 --pretrain \\
        config.MODEL.FSDP_CONFIG.wrap_granularity=block config.MODEL.FSDP_CONFIG.reshard_after_forward=True
"""

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dev" / "recipes"))

from demo_pretrain_then_eval import PRETRAINING, pixel_baselines, print_head_diagnostics, run  # noqa: E402

# the momentum-teacher recipes (issue 44) beside the demos of demo_pretrain_then_eval.py
METHODS = {
    **PRETRAINING,
    "DINO-ViT": "pretrain/dino_vit_demo",
    "DINOv2-ViT": "pretrain/dinov2_vit_demo",
    "DINO": "pretrain/dino_regnet_demo",
    "BYOL": "pretrain/byol_regnet_demo",
    "MAE-ViT": "pretrain/mae_vit_demo",
    "SimMIM-ViT": "pretrain/simmim_vit_demo",
    "IJEPA-ViT": "pretrain/ijepa_vit_demo",
    "MSN-ViT": "pretrain/msn_vit_demo",
    # the joint-embedding family
    "MoCo-v3": "pretrain/mocov3_regnet_demo",
    "MoCo-v3-ViT": "pretrain/mocov3_vit_demo",
    "BarlowTwins": "pretrain/barlow_twins_regnet_demo",
    "VICReg": "pretrain/vicreg_regnet_demo",
    "LeJEPA": "pretrain/lejepa_regnet_demo",
    "SimSiam": "pretrain/simsiam_regnet_demo",
    "NNCLR": "pretrain/nnclr_regnet_demo",
    # the same trunk, views and engine trained with the labels: the control of every row above
    "Supervised": "pretrain/supervised_regnet_demo",
    # any backbone: a timm model as the trunk
    "SimCLR-timm": "pretrain/simclr_timm_demo",
}
# the others: benchmark/linear_eval_regnet
EVAL_CONFIGS = {
    "DINO-ViT": "benchmark/linear_eval_vit",
    "DINOv2-ViT": "benchmark/linear_eval_vit",
    "MAE-ViT": "benchmark/finetune_vit",
    "SimMIM-ViT": "benchmark/finetune_vit",
    "IJEPA-ViT": "benchmark/linear_eval_vit",
    "MSN-ViT": "benchmark/linear_eval_vit",
    "MoCo-v3-ViT": "benchmark/linear_eval_vit",
    "SimCLR-timm": "benchmark/linear_eval_timm",
}
# mean margin over the pixel logistic regression: SimCLR, SwAV and the DINO ViT demo claim more; the
# others ask what DINO's and BYOL's ask
CLAIM_MARGIN = {
    "SimCLR": 1.0, "SwAV": 0.5, "DINO-ViT": 1.0, "DINOv2-ViT": 1.0, "DINO": 0.5, "BYOL": 0.5, "MAE-ViT": 0.0,
    "MoCo-v3": 0.5, "MoCo-v3-ViT": 0.5, "BarlowTwins": 0.5, "VICReg": 0.5, "LeJEPA": 0.5,
    "SimCLR-timm": 0.5, "SimSiam": 0.5, "NNCLR": 0.5, "Supervised": 0.5, "SimMIM-ViT": 0.0, "IJEPA-ViT": 0.0,
    "MSN-ViT": 0.5,
}  # fmt: skip


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", choices=list(METHODS), default="SimCLR")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--out", default="", help="folder for the runs (default ./checkpoints/recipe_seeds_<method>)"
    )
    parser.add_argument("--overwrite", action="store_true", help="delete --out first if it exists")
    parser.add_argument("--pretrain", nargs="*", default=[], help="extra overrides of the pretraining run")
    parser.add_argument("--eval", nargs="*", default=[], help="extra overrides of the linear evaluation")
    parser.add_argument(
        "--eval-config",
        default="",
        help="the evaluation's recipe (default: the method's, e.g. benchmark/finetune_vit for MAE-ViT, "
        "else benchmark/linear_eval_regnet)",
    )
    parser.add_argument(
        "--reuse-pretraining",
        default="",
        help="an earlier --out of the same recipe: evaluate its seeds' pretrained trunks again (another "
        "probe) instead of pretraining; its pretraining times are reported",
    )
    parser.add_argument(
        "--random-control",
        action="store_true",
        help="also run the same linear evaluation on the seed's untrained trunk (no PARAMS_FILE): "
        "what pretraining adds on the feature each probe picks",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 unless the claim holds")
    parser.add_argument(
        "--min-mean-margin",
        type=float,
        default=None,
        help="required mean margin of the chosen feature over the pixel logistic regression "
        "(points; default: SimCLR 1.0, SwAV 0.5)",
    )
    args = parser.parse_args()
    if args.min_mean_margin is None:
        args.min_mean_margin = CLAIM_MARGIN[args.method]
    args.out = Path(args.out or f"./checkpoints/recipe_seeds_{args.method.lower()}").resolve()
    return args


def overrides(values):
    """Accept ``KEY=VALUE`` and ``config.KEY=VALUE`` alike."""
    return [v if v.startswith("config.") else f"config.{v}" for v in values]


def run_seed(args, seed: int) -> dict:
    """Pretrain and linear-evaluate one seed (or read its earlier result): {"top1": {feature: %},
    "cv_top1": {feature: %}, "lr": {feature: lr}, "seconds": {...}, "cpu_per_rank": {...}}."""
    folder = args.out / f"seed_{seed}"
    done = folder / "result.json"
    recipe = {"pretrain_overrides": overrides(args.pretrain), "eval_overrides": overrides(args.eval)}
    if done.exists():
        print(f"\n=== seed {seed}: done before, reading {done}", flush=True)
        record = json.loads(done.read_text())
        if {key: record.get(key, []) for key in recipe} != recipe:
            sys.exit(
                f"{done} was run with other overrides ({record.get('pretrain_overrides')}, "
                f"{record.get('eval_overrides')}): use another --out or --overwrite"
            )
        if args.random_control and "random" not in record:  # a seed run before without the control
            record.update(random_control(args, seed, folder, evaluation_argv(args, seed, folder, ""), {}, {}))
            done.write_text(json.dumps(record, indent=1))
        return record
    pretrain_dir, eval_dir = folder / "pretrain", folder / "linear_eval"
    # An interrupted seed resumes: the launcher continues from the newest complete checkpoint.
    resumed = any(d.is_dir() and any(d.glob("checkpoint_*")) for d in (pretrain_dir, eval_dir))
    seed_arg = f"config.SEED_VALUE={seed}"
    timings, cpu = {}, {}
    if args.reuse_pretraining:
        pretrain_dir = reused_pretraining(args, seed, recipe, timings, cpu)
    else:
        pretrain = [f"config={METHODS[args.method]}", f"config.CHECKPOINT.DIR={pretrain_dir}", seed_arg]
        cpu["pretrain"] = run(
            f"seed {seed} pretrain", pretrain + overrides(args.pretrain), timings, folder / "pretrain.log"
        )
    if args.method == "SwAV":
        print_head_diagnostics(pretrain_dir)
    evaluation = evaluation_argv(args, seed, eval_dir, pretrain_dir)
    cpu["linear_eval"] = run(
        f"seed {seed} linear eval", evaluation + overrides(args.eval), timings, folder / "linear_eval.log"
    )
    results = json.loads((eval_dir / "metrics.json").read_text())["results"]
    control = random_control(args, seed, folder, evaluation, timings, cpu) if args.random_control else {}
    record = {
        "seed": seed,
        **recipe,
        "top1": {name: r["top1"] for name, r in results.items()},
        "cv_top1": {name: r.get("holdout_top1") for name, r in results.items()},
        "lr": {name: r.get("lr") for name, r in results.items()},
        "seconds": {
            "pretrain": timings[f"seed {seed} pretrain"],
            "linear_eval": timings[f"seed {seed} linear eval"],
        },
        "cpu_per_rank": {step: seconds / 2 for step, seconds in cpu.items()},
        "resumed": resumed,  # its times are those of the part run last
        **control,
    }
    done.write_text(json.dumps(record, indent=1))
    return record


def evaluation_argv(args, seed: int, eval_dir: Path, weights) -> list:
    """The launcher's arguments of the method's linear evaluation of ``weights`` into ``eval_dir``."""
    return [
        f"config={args.eval_config or EVAL_CONFIGS.get(args.method, 'benchmark/linear_eval_regnet')}",
        f"config.CHECKPOINT.DIR={eval_dir}",
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={weights}",
        f"config.SEED_VALUE={seed}",
    ]


def random_control(args, seed: int, folder: Path, evaluation, timings: dict, cpu: dict) -> dict:
    """The linear evaluation of ``evaluation`` on the untrained trunk of ``seed`` (the same eval path,
    features, BN handling and probe seed): {"random": {"top1": ..., "cv_top1": ...}}."""
    control_dir = folder / "linear_eval_random"
    argv = [
        arg if not arg.startswith("config.CHECKPOINT.DIR=") else f"config.CHECKPOINT.DIR={control_dir}"
        for arg in evaluation
        if not arg.startswith("config.MODEL.WEIGHTS_INIT.PARAMS_FILE=")
    ]
    name = f"seed {seed} linear eval, random trunk"
    argv.append("config.MODEL.WEIGHTS_INIT.PARAMS_FILE=")
    cpu["random_eval"] = run(name, argv + overrides(args.eval), timings, folder / "linear_eval_random.log")
    results = json.loads((control_dir / "metrics.json").read_text())["results"]
    return {
        "random": {
            "top1": {feature: r["top1"] for feature, r in results.items()},
            "cv_top1": {feature: r.get("holdout_top1") for feature, r in results.items()},
        }
    }


def reused_pretraining(args, seed: int, recipe: dict, timings: dict, cpu: dict) -> Path:
    """The pretraining run of ``seed`` under ``--reuse-pretraining`` (made with the same pretraining
    overrides); its times go into ``timings`` / ``cpu``."""
    folder = Path(args.reuse_pretraining).resolve() / f"seed_{seed}"
    earlier_file = folder / "result.json"
    if not earlier_file.exists():
        sys.exit(f"{earlier_file} does not exist: --reuse-pretraining needs a finished seed {seed} there")
    earlier = json.loads(earlier_file.read_text())
    if earlier.get("pretrain_overrides", []) != recipe["pretrain_overrides"]:
        sys.exit(
            f"{earlier_file} was pretrained with {earlier.get('pretrain_overrides')}, not "
            f"{recipe['pretrain_overrides']}: pass the same --pretrain"
        )
    print(f"\n=== seed {seed}: pretrained in {folder / 'pretrain'}", flush=True)
    timings[f"seed {seed} pretrain"] = earlier["seconds"]["pretrain"]
    cpu["pretrain"] = 2 * earlier["cpu_per_rank"]["pretrain"]
    return folder / "pretrain"


def chosen_feature(record: dict) -> str:
    """The feature with the best cross-validated top-1 on TRAIN: chosen without seeing val."""
    cv = record["cv_top1"]
    return max(cv, key=lambda name: (cv[name] is not None, cv[name] or 0.0))


def claim(records, pixels: dict, min_mean_margin: float):
    """(holds, margins): every seed's chosen feature above the pixel logistic regression and the
    mean margin at least ``min_mean_margin`` points; the margin of each seed."""
    margins = [r["top1"][chosen_feature(r)] - pixels["logistic regression"] for r in records]
    return min(margins) > 0 and statistics.fmean(margins) >= min_mean_margin, margins


def seed_row(record: dict, pixels: dict) -> dict:
    """The printed numbers of one seed: top-1 per feature, chosen, margins, seconds."""
    row = dict(record["top1"])
    row["chosen"] = record["top1"][chosen_feature(record)]
    row["vs logistic"] = row["chosen"] - pixels["logistic regression"]
    row["vs RBF-SVM"] = row["chosen"] - pixels["RBF-SVM"]
    if "random" in record:
        row["random chosen"] = record["random"]["top1"][chosen_feature(record["random"])]
        row["vs random"] = row["chosen"] - row["random chosen"]
    row["pretrain s"] = record["seconds"]["pretrain"]
    row["eval s"] = record["seconds"]["linear_eval"]
    return row


def print_table(args, records, pixels: dict) -> dict:
    """Per-seed rows, then mean +- std and mean +- standard error; returns {column: (mean, std)}."""
    rows = [seed_row(record, pixels) for record in records]
    columns = list(rows[0])
    # features and chosen are accuracies, then margins (and the random trunk's), then times
    percent = len(records[0]["top1"]) + 1
    print(
        f"\n{args.method} ({METHODS[args.method]}"
        + (" " + " ".join(overrides(args.pretrain)) if args.pretrain else "")
        + f") -> {args.eval_config or EVAL_CONFIGS.get(args.method, 'benchmark/linear_eval_regnet')}"
        + (" " + " ".join(overrides(args.eval)) if args.eval else "")
        + ": linear-eval top-1 on the 360 val digits"
    )
    print("| seed | " + " | ".join(columns) + " | CPU/rank s |")
    print("|---" * (len(columns) + 2) + "|")

    def cell(column, value, std=None):
        if columns.index(column) < percent or column == "random chosen":
            return f"{value:.2f}" + (f" ± {std:.2f}" if std is not None else "")
        if column.startswith("vs "):
            return f"{value:+.2f}" + (f" ± {std:.2f}" if std is not None else "")
        return f"{value:.0f}" + (f" ± {std:.0f}" if std is not None else "")

    for record, row in zip(records, rows):
        cpu = " + ".join(f"{record['cpu_per_rank'][step]:.0f}" for step in ("pretrain", "linear_eval"))
        resumed = "*" if record.get("resumed") else ""
        print(
            f"| {record['seed']}{resumed} | " + " | ".join(cell(c, row[c]) for c in columns) + f" | {cpu} |"
        )
    stats = {}
    for column in columns:
        values = [row[column] for row in rows]
        stats[column] = (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
    print("| mean ± std | " + " | ".join(cell(c, *stats[c]) for c in columns) + " | |")
    root_n = len(rows) ** 0.5
    print(
        "| mean ± s.e. | "
        + " | ".join(cell(c, mean, std / root_n) for c, (mean, std) in stats.items())
        + " | |"
    )
    for name, value in pixels.items():
        print(f"raw pixels, {name}: {value:.2f}%")
    chosen_lrs = "; ".join(
        f"seed {r['seed']} " + " / ".join(f"{lr:g}" for lr in r["lr"].values() if lr is not None)
        for r in records
    )
    print(f"probe lrs chosen by cross-validation on TRAIN ({' / '.join(records[0]['lr'])}): {chosen_lrs}")
    return stats


def main() -> int:
    args = parse_args()
    if args.out.exists() and args.overwrite:
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    records = [run_seed(args, seed) for seed in args.seeds]
    pixels = pixel_baselines()
    stats = print_table(args, records, pixels)
    holds, margins = claim(records, pixels, args.min_mean_margin)
    print(
        f"\nclaim (every seed's chosen feature above the pixel logistic regression, mean margin >= "
        f"{args.min_mean_margin:g}): {'holds' if holds else 'does NOT hold'} "
        f"(lowest margin {min(margins):+.2f}, mean {stats['vs logistic'][0]:+.2f}); "
        f"{len(records)} seeds, {time.perf_counter() - start:.0f} s here; runs in {args.out}"
    )
    summary = {
        "method": args.method,
        "pretrain_overrides": overrides(args.pretrain),
        "eval_overrides": overrides(args.eval),
        "pixels": pixels,
        "seeds": records,
        "mean_std": stats,
        "claim_holds": holds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if args.check and not holds else 0


if __name__ == "__main__":
    sys.exit(main())
