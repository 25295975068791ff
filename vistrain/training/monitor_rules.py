"""The training monitor's pure measures and verdicts (``vistrain.training.monitor`` runs them):
RankMe and feature std of a pass's features, the collapse rules, and the rule for a trunk that
learns no better than it started; :class:`History`, what the verdicts remember between passes."""

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

BASELINE = "knn_baseline"  # the kNN top-1 of the trunk before training (one record, iteration 0)
# the part of a run before which "no better than before training" is not told: a trunk leaving its
# random features can read under them for a while (the quick start's kNN: 76.67% after epoch 3 of
# 40, under its bar 77.99%; MoCo v3's demo 70.28% after epoch 4, 80.28% after 10, 87.50% after 14;
# the SimSiam demo 68.6-75.6% up to epoch 16, 80.6% after 20, 88.9% after 36;
# python dev/studies/monitor_baselines.py)
MIN_PROGRESS = 1 / 2
EPS = 1e-7  # RankMe's epsilon (Garrido et al. 2023)
KNOBS = (
    "lower the lr (OPTIMIZER.param_schedulers.lr.base_value), raise the loss's temperature, check the "
    "teacher's temperature and centring (a momentum teacher), lower OPTIMIZER.weight_decay or raise the batch size"
)

VIEW_KNOBS = (
    "try milder or larger views (DATA.TRAIN.TRANSFORMS: SIZE_CROPS, CROP_SCALES, the augmentations' "
    "strength), another lr (OPTIMIZER.param_schedulers.lr.base_value), the loss's temperature, or more "
    "epochs (OPTIMIZER.num_epochs)"
)


# --------------------------------------------------------------------------------------------
# pure measures


def rankme(embeddings: torch.Tensor, eps: float = EPS) -> float:
    """RankMe of ``embeddings`` (N, D): ``exp(-sum_k p_k log p_k)``, ``p_k = s_k / ||s||_1 + eps``,
    s the min(N, D) singular values (computed in float64). r equal non-zero singular values give r
    (to within eps); random Gaussian (N, D) with N >> D gives close to D. NaN where an embedding
    is not finite (the weights diverged: the training loop stops on its loss, in one line)."""
    if not bool(torch.isfinite(embeddings).all()):
        return float("nan")
    s = torch.linalg.svdvals(embeddings.detach().double())
    p = s / s.sum().clamp_min(torch.finfo(torch.float64).tiny) + eps
    return float(torch.exp(-(p * p.log()).sum()))


def sequence_summary(
    features: Dict[str, torch.Tensor], name: str, num_prefix: int
) -> Dict[str, torch.Tensor]:
    """``features`` with ``name`` added from a ViT's "sequence" (N, prefix + L, D) where the trunk
    gave only the sequence: "cls" (N, D) its first token, "avgpool" (N, D) the mean of its L patch
    tokens (after its ``num_prefix`` class and register tokens); as the trunk's own features (all
    read after its final LayerNorm), so the monitor's kNN equals the knn job's on ``name``."""
    if name in features or "sequence" not in features or name not in ("cls", "avgpool"):
        return features
    sequence = features["sequence"]
    summary = sequence[:, 0] if name == "cls" else sequence[:, num_prefix:].mean(1)
    return {**features, name: summary}


def prefix_tokens(trunk: torch.nn.Module) -> int:
    """The class and register tokens before a ViT's patches in its "sequence" (the built-in ViT's
    and a maskable timm one's ``num_prefix``, else timm's ``num_prefix_tokens``; 0 for a CNN)."""
    prefix = getattr(trunk, "num_prefix", None)
    if prefix is None:
        prefix = getattr(getattr(trunk, "timm", None), "num_prefix_tokens", 0)
    return int(prefix)


def feature_std(features: torch.Tensor) -> float:
    """Mean over the D dimensions of the std over the N images (N, D) of the L2-normalised rows."""
    return float(F.normalize(features.detach().double(), dim=1).std(dim=0).mean())


def collapse_reasons(
    values: Dict[str, float], peak_rankme: float, dim: int, rankme_min: float, std_min: float
) -> str:
    """What says the features collapsed ("" when nothing does): RankMe below ``rankme_min`` or
    10x below ``peak_rankme``, feature std below ``std_min / sqrt(dim)``."""
    reasons = []
    if values["rankme"] < rankme_min:
        reasons.append(f"RankMe {values['rankme']:.2f} < MONITOR.RANKME_MIN {rankme_min:g}")
    elif values["rankme"] * 10 < peak_rankme:
        reasons.append(f"RankMe {values['rankme']:.2f} fell 10x from its peak {peak_rankme:.2f}")
    if values["feature_std"] < std_min / math.sqrt(dim):
        reasons.append(
            f"feature std {values['feature_std']:.4f} < MONITOR.STD_MIN / sqrt({dim}) = {std_min / math.sqrt(dim):.4f}"
        )
    return "; ".join(reasons)


def baseline_margin(baseline: float, num_images: int) -> float:
    """Points a kNN top-1 must beat ``baseline`` (%) by: max(2, 2 SE), SE = 100 sqrt(p (1 - p) / n)
    the binomial standard error of a top-1 p = baseline / 100 measured on ``num_images`` = n."""
    p = min(max(baseline / 100.0, 0.0), 1.0)
    return max(2.0, 2.0 * 100.0 * math.sqrt(p * (1.0 - p) / max(num_images, 1)))


def no_better_than_baseline(
    knn: float, baseline: float, num_images: int, passes: int, progress: float
) -> str:
    """Why this pass finds the trunk no better than doing nothing ("" when it is, or too early to
    tell): from the second pass and :data:`MIN_PROGRESS` of the run (``progress``: epochs done /
    epochs) on, its kNN top-1 ``knn`` (%) after ``passes`` passes is not above ``baseline`` (%, the
    same kNN on the trunk before training, ``num_images`` test images) by :func:`baseline_margin`.
    The monitor warns when two passes in a row find it (one pass's kNN moves by a few points)."""
    margin = baseline_margin(baseline, num_images)
    if passes < 2 or progress < MIN_PROGRESS or knn - baseline >= margin:
        return ""
    return (
        f"kNN top-1 {knn:.2f}% after {passes} passes is not above the {baseline:.2f}% the trunk read before "
        f"training by {margin:.1f} points (max of 2 points and 2 standard errors on {num_images} test images)"
    )


@dataclasses.dataclass
class History:
    """What the monitor's verdicts depend on from the passes so far."""

    peak_rankme: float = 0.0
    suspect: bool = False  # the last pass met a collapse rule
    no_better: bool = False  # the last pass found the trunk no better than before training
    passes: int = 0
    baseline: Optional[Tuple[float, int]] = None  # (kNN top-1 % before training, test images)

    @classmethod
    def of(cls, records: List[dict], start: int) -> "History":
        """From the monitor's metrics.jsonl ``records`` (pass records, with ``rankme``; baseline
        records, with :data:`BASELINE`): the passes before iteration ``start`` (one per epoch, the
        latest: a resumed run's passes replace those its earlier run made past its checkpoint; a
        pass at ``start`` came after the checkpoint it resumes and is made again) and the last
        baseline."""
        history = cls()
        passes = {r["epoch"]: r for r in records if "rankme" in r and r["iteration"] < start}
        before = [passes[epoch] for epoch in sorted(passes)]
        if before:
            history.peak_rankme = max(r["rankme"] for r in before)
            history.suspect = bool(before[-1].get("collapse_suspect", 0))
            history.no_better = bool(before[-1].get("no_better_than_baseline", 0))
            history.passes = len(before)
        baselines = [r for r in records if BASELINE in r]
        if baselines:
            history.baseline = (baselines[-1][BASELINE], baselines[-1]["knn_images"])
        return history
