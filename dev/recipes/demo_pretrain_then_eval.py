"""Prints linear-probe top-1 of SimCLR, SwAV and a random trunk beside pixel classifiers, one seed.

Close the loop in one command: pretrain SimCLR and SwAV, then compare their features with a random
trunk and with classifiers on the raw pixels.

On the bundled real digits (1,437 train / 360 val images), through the normal launcher:

1. ``config=regnet_fsdp``: SimCLR pretraining of the quick-start RegNet, sharded over 2 CPU ranks;
2. ``config=pretrain/swav_regnet_demo``: SwAV pretraining of the same trunk;
3. ``config=benchmark/linear_eval_regnet`` on (a) the SimCLR trunk, (b) the SwAV trunk, (c) the same
   architecture randomly initialised (same seed, no weights loaded): a linear head on every
   ``BENCHMARK.FEATURES`` entry, each head's lr chosen by 3-fold cross-validation on the TRAIN digits;
4. raw pixels (the original 8x8 grey levels, same split), scikit-learn: logistic regression on
   standardised pixels and an RBF-SVM, their C (and gamma) chosen by 5-fold cross-validation on the
   TRAIN digits;
5. ``--knn``: ``config=benchmark/knn_regnet`` for the three trunks as a second signal.

Prints every command and its run time, the SwAV head's collapse statistics
(``dev/recipes/swav_diagnostics.py``: prototypes winning on val, mean pairwise cosine of the embeddings,
final loss against ln K), then one top-1 table. Exits 1 unless every pretrained trunk beats the
raw-pixel logistic regression on its best feature.

    python dev/recipes/demo_pretrain_then_eval.py                       # ./checkpoints/demo_pretrain_then_eval
    python dev/recipes/demo_pretrain_then_eval.py --out /tmp/demo --overwrite --knn
    python dev/recipes/demo_pretrain_then_eval.py --methods SwAV        # one method (and random init) only
"""

import argparse
import json
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "tools" / "run_distributed.py"
PRETRAINING = {"SimCLR": "regnet_fsdp", "SwAV": "pretrain/swav_regnet_demo"}


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="./checkpoints/demo_pretrain_then_eval", help="folder for the runs")
    parser.add_argument("--overwrite", action="store_true", help="delete --out first if it exists")
    parser.add_argument("--knn", action="store_true", help="also run the kNN benchmark on every trunk")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(PRETRAINING),
        default=list(PRETRAINING),
        help="methods to pretrain",
    )
    return parser.parse_args()


def run(name: str, argv, timings: dict, log: Optional[Path] = None) -> float:
    """One launcher run as a subprocess; stop the demo if it fails. Its output streams through,
    or goes to ``log`` (whose tail is printed on failure). Records the wall time in
    ``timings[name]``; returns the CPU seconds (user + system) of the launcher and its ranks."""
    command = [sys.executable, str(LAUNCHER), *argv]
    print(f"\n=== {name}: {shlex.join(command)}" + (f" > {log}" if log else ""), flush=True)
    start, cpu_before = time.perf_counter(), _children_cpu_seconds()
    if log is None:
        result = subprocess.run(command, cwd=REPO)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            result = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    timings[name] = time.perf_counter() - start
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:]) + "\n" if log else ""
        sys.exit(f"{tail}{name} failed (exit code {result.returncode}); see its output above")
    cpu = _children_cpu_seconds() - cpu_before
    print(f"=== {name}: done in {timings[name]:.0f} s ({cpu:.0f} s CPU)", flush=True)
    return cpu


def _children_cpu_seconds() -> float:
    """User + system CPU time of every finished child process (and theirs) of this one."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def top1(run_dir: Path) -> dict:
    results = json.loads((run_dir / "metrics.json").read_text())["results"]
    return {name: res["top1"] for name, res in results.items()}


def pixel_baselines() -> dict:
    """Top-1 (%) of scikit-learn classifiers on the 8x8 pixels of the demo split, hyper-parameters
    chosen by 5-fold cross-validation on the TRAIN digits only."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    from vistrain.data.digits_source import split_ids

    pixels, labels = load_digits(return_X_y=True)
    ids = split_ids(labels)
    train, val = ids["train"], ids["val"]
    models = {
        "logistic regression": GridSearchCV(
            make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)),
            {"logisticregression__C": [0.01, 0.1, 1.0, 10.0]},
            cv=5,
        ),
        "RBF-SVM": GridSearchCV(SVC(kernel="rbf"), {"C": [1, 10, 100], "gamma": ["scale", 1e-3]}, cv=5),
    }
    results = {}
    for name, model in models.items():
        model.fit(pixels[train], labels[train])
        results[name] = 100.0 * model.score(pixels[val], labels[val])
        print(f"raw pixels, {name}: {model.best_params_} -> {results[name]:.2f}%", flush=True)
    return results


def print_head_diagnostics(run_dir: Path) -> None:
    """Has the SwAV head collapsed? (dev/recipes/swav_diagnostics.py, on the val digits, one process)"""
    sys.path.insert(0, str(REPO / "dev" / "recipes"))
    from swav_diagnostics import diagnose, format_line

    from vistrain.methods import load_config

    cfg = load_config([f"config={run_dir / 'config.yaml'}"])
    print(format_line("SwAV head", diagnose(cfg, str(run_dir), probe=False)), flush=True)


def print_table(engine: str, trunks: dict, pixels: dict) -> None:
    """One row per trunk (top-1 per evaluated feature and the best), then the pixel baselines."""
    features = list(next(iter(trunks.values())))  # the benchmark config's BENCHMARK.FEATURES
    print(f"\n{engine}: top-1 on the 360 validation digits")
    print(f"| features | {' | '.join(features)} | best |")
    print(f"|---|{'---|' * (len(features) + 1)}")
    for name, result in trunks.items():
        cells = " | ".join(f"{result[f]:.2f}%" for f in features)
        print(f"| {name} | {cells} | **{max(result.values()):.2f}%** |")
    for name, value in pixels.items():
        print(f"| raw pixels, {name} | {' | '.join('' for _ in features)} | {value:.2f}% |")


def main() -> int:
    args = parse_args()
    out = Path(args.out).resolve()
    if out.exists():
        if not args.overwrite:
            sys.exit(f"{out} exists: pass --overwrite to replace it, or choose another --out")
        shutil.rmtree(out)
    timings, start = {}, time.perf_counter()
    weights = {"random init": ""}
    for method in args.methods:
        config, run_dir = PRETRAINING[method], out / f"pretrain_{method.lower()}"
        run(f"pretrain {method}", [f"config={config}", f"config.CHECKPOINT.DIR={run_dir}"], timings)
        weights[f"{method} ({config})"] = str(run_dir)
        if method == "SwAV":
            print_head_diagnostics(run_dir)
    weights = {name: weights[name] for name in [*list(weights)[1:], "random init"]}

    benchmarks = {"linear_eval": "benchmark/linear_eval_regnet"}
    if args.knn:
        benchmarks["knn"] = "benchmark/knn_regnet"
    results = {engine: {} for engine in benchmarks}
    for engine, config in benchmarks.items():
        for index, (name, path) in enumerate(weights.items()):
            run_dir = out / f"{engine}_{index}"
            argv = [f"config={config}", f"config.CHECKPOINT.DIR={run_dir}"]
            if path:
                argv.append(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={path}")
            run(f"{engine} ({name})", argv, timings)
            results[engine][name] = top1(run_dir)
    pixels = pixel_baselines()

    print(
        "\nrun times: "
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items())
        + f"; total {time.perf_counter() - start:.0f} s"
    )
    for engine in benchmarks:
        print_table(engine, results[engine], pixels if engine == "linear_eval" else {})
    baseline = pixels["logistic regression"]
    pretrained = {n: max(r.values()) for n, r in results["linear_eval"].items() if n != "random init"}
    beaten = all(best > baseline for best in pretrained.values())
    verdict = "beat" if beaten else "do NOT all beat"
    print(
        f"\npretrained trunks {verdict} the raw-pixel logistic regression ({baseline:.2f}%): "
        + ", ".join(f"{n} {v:.2f}%" for n, v in pretrained.items())
        + f"; runs in {out}"
    )
    return 0 if beaten else 1


if __name__ == "__main__":
    sys.exit(main())
