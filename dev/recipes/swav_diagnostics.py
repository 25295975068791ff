"""Prints whether a SwAV head collapsed: prototypes used, embedding spread, final loss (and a probe).

Has a SwAV run's head collapsed? Prototype usage, embedding spread and final loss, plus an
optional scikit-learn screening probe of the frozen trunk features.

SwAV's trivial solution: every embedding points the same way, every image is assigned to the same
prototype (or to none in particular), the predictions are uniform and the loss sits at ln K. On
the centre crops of the val digits (the test transform, eval mode) this reports:

* ``prototypes_used``: how many of the K prototypes win the argmax of the scores for at least one
  image (1 when collapsed), and ``top_share``, the fraction of images won by the busiest one;
* ``mean_cosine``: mean pairwise cosine of the normalised embeddings (off-diagonal; ~1 when
  collapsed);
* ``final_loss`` (the last logged training loss, from ``metrics.jsonl``) against ``ln_k``;
* ``--probe``: logistic regression (standardised features, C from {0.01, 0.1, 1} by 3-fold
  cross-validation on TRAIN) on the frozen s2 / s3 / avgpool features of the centre crops, top-1
  on val: the quick screening probe of docs/notes/ssl-recipes.md (not the shipped linear evaluation).

    python dev/recipes/swav_diagnostics.py ./checkpoints/swav_regnet_demo --probe
    python dev/recipes/swav_diagnostics.py --random config=pretrain/swav_regnet_demo --probe   # random init
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vistrain.benchmarks.common import pool_feature  # noqa: E402
from vistrain.checkpoint import load_pretrained  # noqa: E402
from vistrain.data import build_loader, set_epoch  # noqa: E402
from vistrain.methods import build_model, load_config  # noqa: E402

FEATURES = ["s2", "s3", "avgpool"]
POOL_SIZE = 2  # as configs/benchmark/linear_eval_regnet.yaml


def _eval_config(cfg):
    """Model with the trunk returning FEATURES; both splits with the test transform, in order."""
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.TRUNK.OUT_FEATURES = FEATURES
    cfg.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN = False
    cfg.DATA.TRAIN.TRANSFORMS = cfg.DATA.TEST.TRANSFORMS.clone()
    cfg.DATA.TRAIN.TRANSFORMS.NAME = "eval"
    for split in ("TRAIN", "TEST"):
        cfg.DATA[split].SHUFFLE = cfg.DATA[split].DROP_LAST = False
        cfg.DATA[split].BATCHSIZE_PER_REPLICA = 128
    cfg.freeze()
    return cfg


@torch.no_grad()
def feature_pass(model, loader) -> Dict[str, torch.Tensor]:
    """Trunk features, head embeddings and scores (first prototype layer), labels of one split."""
    set_epoch(loader, 0)
    out = {name: [] for name in [*FEATURES, "z", "scores", "label"]}
    for batch in loader:
        images = batch["crops"][0]
        feats = model.trunk(images)
        for name in FEATURES:
            out[name].append(pool_feature(feats[name], POOL_SIZE))
        if model.head is not None:
            z, scores = model.head(feats["avgpool"])
            out["z"].append(z)
            out["scores"].append(scores[0])
        out["label"].append(batch["label"])
    return {name: torch.cat(values) for name, values in out.items() if values}


def head_diagnostics(z: torch.Tensor, scores: torch.Tensor) -> dict:
    """Collapse statistics of normalised embeddings z (N, D) and prototype scores (N, K)."""
    n, k = scores.shape
    wins = torch.bincount(scores.argmax(dim=1), minlength=k)
    cos = z @ z.t()
    mean_cos = (cos.sum() - cos.diagonal().sum()) / (n * (n - 1))
    return {
        "prototypes_used": int((wins > 0).sum()),
        "num_prototypes": k,
        "top_share": float(wins.max()) / n,
        "mean_cosine": float(mean_cos),
        "max_score_mean": float(scores.max(dim=1).values.mean()),
        "ln_k": math.log(k),
    }


def final_loss(run_dir: Path) -> Optional[float]:
    """The last loss logged in ``run_dir/metrics.jsonl`` (None when there is none)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records if "loss" in r]
    return losses[-1] if losses else None


def screening_probe(train: dict, val: dict) -> Dict[str, float]:
    """Top-1 (%) on val of a logistic regression per frozen feature (C by 3-fold CV on TRAIN)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    results = {}
    for name in FEATURES:
        model = GridSearchCV(
            make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000)),
            {"logisticregression__C": [0.01, 0.1, 1.0]},
            cv=3,
        )
        model.fit(train[name].numpy(), train["label"].numpy())
        results[name] = 100.0 * model.score(val[name].numpy(), val["label"].numpy())
    return results


def load_run(path: str):
    """(config, weights) of a run folder, or of one checkpoint_<N> inside it."""
    weights = Path(path).resolve()
    run_dir = weights if (weights / "config.yaml").exists() else weights.parent
    return load_config([f"config={run_dir / 'config.yaml'}"]), str(weights)


def eval_model(cfg, weights: str):
    """(model in eval mode returning FEATURES, its eval config) for ``cfg`` with ``weights``
    ("": random init, seeded); the head is kept only for SwAV."""
    torch.manual_seed(cfg.SEED_VALUE)
    cfg = _eval_config(cfg)
    model = build_model(cfg.MODEL)
    if weights:
        weights_cfg = cfg.MODEL.WEIGHTS_INIT.clone()
        weights_cfg.defrost()
        weights_cfg.PARAMS_FILE, weights_cfg.SKIP_LAYERS = weights, []
        load_pretrained(model, weights_cfg)
    model.eval()
    if cfg.MODEL.HEAD.NAME != "swav":
        model.head = None
    return model, cfg


def diagnose(cfg, weights: str, probe: bool) -> dict:
    """Everything above for the model of ``cfg`` with ``weights`` ("" : random init)."""
    model, cfg = eval_model(cfg, weights)
    device = torch.device("cpu")
    val = feature_pass(model, build_loader(cfg.DATA, "TEST", cfg.SEED_VALUE, device, rank=0, world_size=1))
    result = head_diagnostics(val["z"], val["scores"]) if "z" in val else {}
    if weights:
        result["final_loss"] = final_loss(Path(weights))
    if probe:
        train = feature_pass(
            model, build_loader(cfg.DATA, "TRAIN", cfg.SEED_VALUE, device, rank=0, world_size=1)
        )
        result["probe_top1"] = screening_probe(train, val)
    return result


def format_line(name: str, result: dict) -> str:
    parts = []
    if "prototypes_used" in result:
        parts.append(
            f"prototypes winning on val {result['prototypes_used']}/{result['num_prototypes']} "
            f"(busiest {100 * result['top_share']:.0f}%), mean cosine {result['mean_cosine']:.3f}"
        )
    if result.get("final_loss") is not None:
        parts.append(f"final loss {result['final_loss']:.3f} (ln K {result['ln_k']:.3f})")
    if "probe_top1" in result:
        parts.append("sk probe " + " / ".join(f"{result['probe_top1'][f]:.2f}" for f in FEATURES))
    return f"{name}: " + "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", nargs="?", help="a SwAV pretraining run folder (holds config.yaml)")
    parser.add_argument("--random", nargs="*", help="random init: config=NAME [overrides] instead of a run")
    parser.add_argument("--probe", action="store_true", help="also run the sklearn screening probe")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.random is not None:
        cfg, weights, name = load_config(args.random), "", "random init"
    else:
        cfg, weights = load_run(args.run_dir)
        name = Path(weights).name
    result = diagnose(cfg, weights, args.probe)
    print(json.dumps(result) if args.json else format_line(name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
