"""Prints a quick probe's val top-1 for each trunk feature of a run: which feature to read.

Which trunk feature should the linear evaluation read? A quick screen on a run's frozen features.

For a pretraining run (or a random trunk), computes the trunk's stage maps on the centre crops of
the bundled digits (the test transform, eval mode, one process) and, for every feature spec, fits
the screening probe of docs/notes/ssl-recipes.md (section 7) (scikit-learn logistic regression on standardised
features, C from {0.01, 0.1, 1} by 3-fold cross-validation on TRAIN) and prints its val top-1
(and the CV top-1 on TRAIN that chose C). A spec is ``name@P`` (stage ``name`` average-pooled to
P x P, as ``BENCHMARK.POOL_SIZE``; ``avgpool`` takes no P) or several joined by ``+``
(concatenated). Screening only: the numbers the README quotes come from the shipped linear
evaluation (``dev/recipes/recipe_seeds.py``).

    python dev/studies/probe_features.py RUN_DIR [RUN_DIR ...]
    python dev/studies/probe_features.py --random config=regnet_fsdp config.SEED_VALUE=1
    python dev/studies/probe_features.py RUN_DIR --specs s2@2 s2@4 s1@4+s2@2
"""

import argparse
import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dev" / "recipes"))

import swav_diagnostics  # noqa: E402

from vistrain.data import build_loader, set_epoch  # noqa: E402
from vistrain.methods import load_config  # noqa: E402

STAGES = ["stem", "s1", "s2", "s3", "avgpool"]
DEFAULT_SPECS = [
    "s2@2", "s3@2", "avgpool", "s2@4+s3@2",  # the shipped probe's features
    "s1@2", "s1@4", "s2@1", "s2@3", "s2@4", "s3@1",
    "s2@2+s3@2+avgpool", "s1@4+s2@2", "s1@4+s2@4+s3@2+avgpool",
]  # fmt: skip


def stage_maps(cfg, weights: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """{"train"|"val": {stage: (N, C, h, w) or (N, C), "label": (N,)}} of the frozen trunk."""
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.HEAD.NAME = "simclr"  # eval_model keeps only a SwAV head; none is needed here
    cfg.DATA.TRAIN.DATA_LIMIT = -1  # the probe reads every TRAIN digit, whatever pretraining read
    cfg.freeze()
    model, eval_cfg = swav_diagnostics.eval_model(cfg, weights)
    model.trunk.out_features = STAGES  # the trunk returns every stage
    device = torch.device("cpu")
    out = {}
    for split, key in (("train", "TRAIN"), ("val", "TEST")):
        loader = build_loader(eval_cfg.DATA, key, eval_cfg.SEED_VALUE, device, rank=0, world_size=1)
        set_epoch(loader, 0)
        maps: Dict[str, List[torch.Tensor]] = {name: [] for name in [*STAGES, "label"]}
        with torch.no_grad():
            for batch in loader:
                feats = model.trunk(batch["crops"][0])
                for name in STAGES:
                    maps[name].append(feats[name])
                maps["label"].append(batch["label"])
        out[split] = {name: torch.cat(values) for name, values in maps.items()}
    return out


def spec_features(maps: Dict[str, torch.Tensor], spec: str) -> torch.Tensor:
    """(N, D) features of ``spec`` (``s2@2+avgpool``...) from ``stage_maps`` of one split."""
    parts = []
    for part in spec.split("+"):
        name, _, pool = part.partition("@")
        feature = maps[name]
        if feature.dim() == 4:
            feature = torch.flatten(F.adaptive_avg_pool2d(feature, int(pool or 1)), 1)
        parts.append(feature)
    return torch.cat(parts, dim=1).numpy()


def screen(maps, specs: List[str]) -> Dict[str, tuple]:
    """{spec: (val top-1 %, CV top-1 % on TRAIN, dims)} of the screening logistic regression."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    results = {}
    for spec in specs:
        x, xv = spec_features(maps["train"], spec), spec_features(maps["val"], spec)
        model = GridSearchCV(
            make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000)),
            {"logisticregression__C": [0.01, 0.1, 1.0]},
            cv=3,
        )
        model.fit(x, maps["train"]["label"].numpy())
        val = 100.0 * model.score(xv, maps["val"]["label"].numpy())
        results[spec] = (val, 100.0 * model.best_score_, x.shape[1])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="*", help="pretraining run folders (or checkpoint_<N> in one)")
    parser.add_argument("--random", nargs="*", help="random init: config=NAME [overrides] instead of runs")
    parser.add_argument("--specs", nargs="+", default=DEFAULT_SPECS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [("random init", load_config(args.random), "")] if args.random is not None else []
    runs += [(path, *swav_diagnostics.load_run(path)) for path in args.run_dirs]
    print("| run | " + " | ".join(args.specs) + " |")
    print("|---" * (len(args.specs) + 1) + "|")
    for name, cfg, weights in runs:
        results = screen(stage_maps(cfg, weights), args.specs)
        cells = [f"{val:.2f} ({cv:.1f}, {dims}d)" for val, cv, dims in results.values()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print("cells: val top-1 % (CV top-1 % on TRAIN, feature width)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
