"""Prints ELPV baselines without learnt features per split seed: majority class, pixel LR and SVM.

Baselines without learnt features on ELPV, over split seeds: what a pretrained trunk must beat.

For every ``DATA.SPLIT_SEED`` in ``--seeds`` the split is vistrain's own (``vistrain.data.elpv``:
1,968 train / 656 test cells, stratified by (class, type)); on it:

* majority class (of the training cells);
* logistic regression on standardised pixels (cells resized to ``--sides``, bilinear; lbfgs, at
  most 2,000 iterations), C chosen among 0.01, 0.1, 1 by 3-fold cross-validation on the training
  cells (``--no-tune``: C = 1);
* RBF-SVM on the same pixels (gamma "scale"), C chosen among 1, 10, 100 likewise (``--no-tune``: 1).

Both protocols: 4 classes (defect probability 0, 1/3, 2/3, 1) and 2 (functional vs defective,
p >= 0.5), each model trained for its protocol. Prints one row per (model, side) with every seed's
test accuracy and the mean +- sample std; ``--json`` writes them. Needs ``pip install -e ".[elpv]"``
and scikit-learn. About 8 minutes on one busy core for 5 seeds at 32 and 64 px with ``--no-tune``.

    OMP_NUM_THREADS=1 python dev/recipes/elpv_baselines.py                  # seeds 0-4, 32 and 64 px
    python dev/recipes/elpv_baselines.py --seeds 7 --sides 32 --json /tmp/b.json
    python dev/recipes/elpv_baselines.py --sides 64 --models "pixel RBF-SVM" --views dihedral
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vistrain.data.elpv import DEFECTIVE_FROM, package_folder, read_labels, stratified_split


def load_pixels(paths, side: int, views: str = "identity") -> np.ndarray:
    """(N, side * side) float32 in [0, 1]: every cell resized to side x side (bilinear); with
    ``views`` "dihedral" each cell is the mean of its 8 quarter turns and mirrors (the pixels'
    analogue of the probe's ``BENCHMARK.FEATURE_VIEWS: dihedral``)."""
    rows = []
    for path in paths:
        with Image.open(path) as image:
            rows.append(np.asarray(image.convert("L").resize((side, side), Image.BILINEAR), dtype=np.float32))
    cells = np.stack(rows) / 255.0
    if views == "dihedral":
        turned = [np.rot90(cells, turns, axes=(1, 2)) for turns in range(4)]
        cells = sum(t + t[:, :, ::-1] for t in turned) / 8.0
    return cells.reshape(len(rows), -1)


GRIDS = {"pixel LR": [0.01, 0.1, 1.0], "pixel RBF-SVM": [1.0, 10.0, 100.0]}  # C, picked on TRAIN


def scores(train_x, train_y, test_x, test_y, tune: bool, chosen: dict, names=tuple(GRIDS)) -> dict:
    """Test accuracy (%) of the three baselines trained on (train_x, train_y); each model's C
    (cross-validated on the training cells when ``tune``) is appended to ``chosen[name]``; only the
    models in ``names`` are trained."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV, StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    majority = np.bincount(train_y).argmax()
    out = {"majority": 100.0 * float(np.mean(test_y == majority))}
    models = {
        "pixel LR": make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000)),
        "pixel RBF-SVM": make_pipeline(StandardScaler(), SVC(C=1.0, kernel="rbf", gamma="scale")),
    }
    for name, model in models.items():
        if name not in names:
            continue
        if tune:
            key = f"{model.steps[-1][0]}__C"
            folds = StratifiedKFold(3, shuffle=True, random_state=0)
            model = GridSearchCV(model, {key: GRIDS[name]}, cv=folds).fit(train_x, train_y)
            chosen.setdefault(name, []).append(model.best_params_[key])
        else:
            model.fit(train_x, train_y)
        out[name] = 100.0 * float(np.mean(model.predict(test_x) == test_y))
    return out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="DATA.SPLIT_SEED values"
    )
    parser.add_argument("--sides", type=int, nargs="+", default=[32, 64], help="pixel resolutions")
    parser.add_argument("--folder", default="", help="ELPV folder (default: the installed elpv-dataset)")
    parser.add_argument("--json", default="", help="write every number here")
    parser.add_argument("--no-tune", action="store_true", help="C = 1 instead of 3-fold CV on TRAIN")
    parser.add_argument("--models", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    parser.add_argument(
        "--views", default="identity", choices=["identity", "dihedral"],
        help="dihedral: each cell averaged over its 8 quarter turns and mirrors",
    )  # fmt: skip
    args = parser.parse_args()

    start = time.perf_counter()
    paths, classes, types = read_labels(args.folder or package_folder())
    protocols = {"4 classes": classes, "2 classes": (classes >= DEFECTIVE_FROM).astype(np.int64)}
    table = {}  # (protocol, model, side) -> [accuracy per seed]
    chosen = {}  # model -> [C per (side, seed, protocol)]
    for side in args.sides:
        pixels = load_pixels(paths, side, args.views)
        for seed in args.seeds:
            train, test = stratified_split(list(zip(classes.tolist(), types.tolist())), seed)
            for protocol, labels in protocols.items():
                result = scores(
                    pixels[train], labels[train], pixels[test], labels[test], not args.no_tune, chosen,
                    args.models,
                )  # fmt: skip
                for model, accuracy in result.items():
                    table.setdefault((protocol, model, side), []).append(accuracy)
            print(f"  {side} px, split seed {seed} done ({time.perf_counter() - start:.0f} s)", flush=True)

    print(f"\nELPV test accuracy (%), 656 test cells, split seeds {args.seeds}:")
    print(f"  {'protocol':<10} {'model':<14} {'px':>4}  {'mean':>6} {'std':>5}   per seed")
    rows = []
    for (protocol, model, side), values in sorted(
        table.items(), key=lambda kv: (-int(kv[0][0][0]), kv[0][1], kv[0][2])
    ):
        if model == "majority" and side != args.sides[0]:
            continue  # no pixels involved
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        shown = " ".join(f"{v:.1f}" for v in values)
        px = "-" if model == "majority" else str(side)
        print(f"  {protocol:<10} {model:<14} {px:>4}  {statistics.mean(values):6.2f} {std:5.2f}   {shown}")
        rows.append({"protocol": protocol, "model": model, "side": side, "per_seed": values,
                     "mean": statistics.mean(values), "std": std})  # fmt: skip
    for name, values in chosen.items():
        print(f"  {name}: C chosen by cross-validation on TRAIN: {values}")
    if args.json:
        record = {
            "seeds": args.seeds,
            "tuned": not args.no_tune,
            "views": args.views,
            "chosen_C": chosen,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
