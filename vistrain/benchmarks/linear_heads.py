"""Linear heads on a frozen trunk's features: the heads, where their features come from (the trunk
every batch, or a bank computed once), their training and their test counts.

Used by linear evaluation (:mod:`vistrain.benchmarks.linear_eval`) and its pictures; the heads are
data parallel (DDP), the features the frozen trunk's (:mod:`vistrain.benchmarks.common`).
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks import common
from vistrain.data import set_epoch
from vistrain.distributed import comm
from vistrain.fsdp import unwrap
from vistrain.optim import build_lr_schedule, build_optimizer, set_lr
from vistrain.runtime.logger import TrainingMeter


class LinearHeads(nn.Module):
    """One ``BatchNorm1d(D, affine=False) -> Linear(D, num_classes)`` per head.

    ``forward({feature: (N, D_feature) float32})`` -> ``{head key: logits (N, num_classes)}``. By
    default there is one head per feature, keyed by the feature's name; ``inputs`` ({head key:
    feature}) allows several heads per feature (a learning-rate grid) and ``lrs`` ({head key:
    peak lr}) gives heads their own learning rate (absent: ``OPTIMIZER``'s schedule). The
    parameter-free BatchNorm standardises features whose scales differ wildly between stages, so
    one learning rate suits every head (VISSL's "eval_mlp").
    """

    def __init__(
        self,
        dims: Dict[str, int],
        num_classes: int,
        inputs: Optional[Dict[str, str]] = None,
        lrs: Optional[Dict[str, float]] = None,
    ):
        super().__init__()
        self.inputs = dict(inputs) if inputs is not None else {name: name for name in dims}
        self.lrs = dict(lrs or {})
        self.heads = nn.ModuleDict()
        for key, feature in self.inputs.items():
            linear = nn.Linear(dims[feature], num_classes)
            nn.init.normal_(linear.weight, std=0.01)
            nn.init.zeros_(linear.bias)
            self.heads[key] = nn.Sequential(nn.BatchNorm1d(dims[feature], affine=False), linear)

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {key: head(features[self.inputs[key]]) for key, head in self.heads.items()}


@dataclasses.dataclass
class FrozenFeatures:
    """Batch -> (pooled trunk features {name: (B, D) float32}, labels (B,)) on ``device``."""

    trunk: nn.Module
    names: List[str]
    pool_size: int
    dtype: Optional[torch.dtype]  # autocast of the trunk forward; None: fp32
    device: torch.device
    views: str = "identity"  # BENCHMARK.FEATURE_VIEWS

    def __call__(self, batch: dict):
        images, labels = batch["crops"][0].to(self.device), batch["label"].to(self.device)
        features = common.trunk_features(
            self.trunk, images, self.names, self.pool_size, self.dtype, self.views
        )
        return features, labels


@dataclasses.dataclass
class CachedFeatures:
    """Batch -> (features looked up by sample index in a bank, labels (B,)) on ``device``.

    For a deterministic TRAIN transform (``NAME: eval``) the frozen trunk gives every image the same
    features in every epoch, so they are computed once (:func:`cache_features`) instead of once per
    epoch and per learning-rate pass. ``bank[name]`` is (N, D) float32; ``rows[i]`` is the bank row
    of data set index i.
    """

    names: List[str]
    bank: Dict[str, torch.Tensor]
    rows: torch.Tensor
    device: torch.device

    def __call__(self, batch: dict):
        rows = self.rows[batch["index"].to(self.device)]
        return {name: self.bank[name][rows] for name in self.names}, batch["label"].to(self.device)

    @staticmethod
    def batches(loader):
        """The batches ``loader`` would yield, as {"index", "label"} only: the same samples in the
        same order (its sampler's), without reading or transforming a single image."""
        dataset = loader.dataset
        parent = torch.as_tensor(dataset.indices) if hasattr(dataset, "indices") else None  # IndexSubset
        labels = torch.as_tensor(dataset.targets)
        keys = torch.tensor([index for index, _ in loader.sampler], dtype=torch.long)
        for start in range(0, len(keys), loader.batch_size):
            chunk = keys[start : start + loader.batch_size]
            if loader.drop_last and len(chunk) < loader.batch_size:
                return
            yield {"index": chunk if parent is None else parent[chunk], "label": labels[chunk]}


def cache_features(source: FrozenFeatures, data_cfg, seed: int, indices=None) -> CachedFeatures:
    """Collective: one pass of the trunk over DATA.TRAIN (its samples ``indices`` when given: a
    label fraction's; in order, nothing dropped), every rank's features gathered so that each rank
    holds the whole bank."""
    loader = common.ordered_loader(data_cfg, "TRAIN", seed, source.device, indices)
    feats, _, indices = common.extract(
        source.trunk, loader, source.names, source.pool_size, source.dtype, source.device, source.views
    )
    indices, banks = common.gather_unique(indices, *[feats[name] for name in source.names])
    rows = torch.full((int(indices.max()) + 1,), -1, dtype=torch.long, device=source.device)
    rows[indices] = torch.arange(indices.shape[0], device=source.device)
    return CachedFeatures(source.names, dict(zip(source.names, banks)), rows, source.device)


def train_heads(
    source: FrozenFeatures, heads: nn.Module, loader, opt_cfg, meter: TrainingMeter, first_iteration: int = 0
) -> int:
    """``opt_cfg.num_epochs`` epochs of SGD on the heads (cross-entropy summed over heads).

    A head with its own lr follows the schedule scaled by lr / ``base_value``. Returns the
    iteration count (``first_iteration`` plus this pass's). The trunk only ever runs under
    ``no_grad`` in eval mode.
    """
    optimizers = _head_optimizers(opt_cfg, unwrap(heads))
    lr_schedule = build_lr_schedule(opt_cfg, len(loader))
    iteration = first_iteration
    for epoch in range(opt_cfg.num_epochs):
        set_epoch(loader, epoch)
        heads.train()
        batches = source.batches(loader) if isinstance(source, CachedFeatures) else loader
        for step, batch in enumerate(batches):
            lr = lr_schedule(epoch * len(loader) + step)
            for optimizer, scale in optimizers:
                set_lr(optimizer, lr * scale)
            features, labels = source(batch)
            logits = heads(features)
            # the heads are independent, so the sum's gradient is every head's own gradient
            loss = sum(F.cross_entropy(head_logits, labels) for head_logits in logits.values())
            for optimizer, _ in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for optimizer, _ in optimizers:
                optimizer.step()
            meter.update(loss.detach() / len(logits), num_images=labels.shape[0])
            iteration += 1
            if meter.should_log(iteration):
                meter.log(iteration, epoch, opt_cfg.num_epochs, lr)
    return iteration


def _head_optimizers(opt_cfg, heads: LinearHeads) -> List[Tuple[torch.optim.Optimizer, float]]:
    """One (optimizer, lr scale) per distinct head lr; heads without one follow the schedule (scale 1)."""
    base = float(opt_cfg.param_schedulers.lr.base_value)
    by_scale: Dict[float, List[str]] = {}
    for key in heads.heads:
        lr = heads.lrs.get(key)
        if lr is not None and base <= 0:
            raise ValueError("per-head learning rates scale the schedule: lr.base_value must be > 0")
        by_scale.setdefault(1.0 if lr is None else lr / base, []).append(key)
    return [
        (build_optimizer(opt_cfg, nn.ModuleDict({k: heads.heads[k] for k in keys})), scale)
        for scale, keys in by_scale.items()
    ]


@torch.no_grad()
def evaluate(source: FrozenFeatures, heads: nn.Module, loader, groups=()) -> Dict[str, dict]:
    """Collective: top-1/top-5 of every head over ``loader``'s data set, each image counted once;
    with ``groups`` (BENCHMARK.CLASS_GROUPS) also ``top1_<len(groups)>class``.

    Returns ``{head key: {"top1": %, "top5": %, ["top1_2class": %,] "num_images": int}}``, equal on all ranks.
    """
    heads.eval()
    set_epoch(loader, 0)
    names = list(unwrap(heads).heads)
    metrics = metric_names(groups)
    hits = [torch.zeros(0, len(names), len(metrics), dtype=torch.bool, device=source.device)]
    indices = [torch.zeros(0, dtype=torch.long, device=source.device)]
    for batch in loader:
        features, labels = source(batch)
        logits = heads(features)
        hits.append(torch.stack([class_hits(logits[n], labels, groups) for n in names], dim=1))  # (B, H, M)
        indices.append(batch["index"].to(source.device))
    return summed_hits(torch.cat(hits), torch.cat(indices), names, metrics)


def summed_hits(hits: torch.Tensor, indices: torch.Tensor, names, metrics) -> Dict[str, dict]:
    """Collective: this rank's ``hits`` (N_r, H, M) bool of samples ``indices`` (N_r,) -> every
    rank's, each data set index counted once, as :func:`vistrain.benchmarks.common.summarise`
    percentages per name (H ``names``, M ``metrics``)."""
    keep = common.unique_on_this_rank(indices)
    counts = torch.zeros(len(names), len(metrics) + 1, dtype=torch.float64, device=hits.device)
    counts[:, :-1] = hits[keep].sum(dim=0).to(torch.float64)
    counts[:, -1] = keep.sum()
    return common.summarise(comm.all_reduce_sum(counts), names, metrics)


def metric_names(groups) -> List[str]:
    """top1, top5 [, top1_<n>class for BENCHMARK.CLASS_GROUPS of n groups]."""
    return ["top1", "top5"] + ([f"top1_{len(groups)}class"] if groups else [])


def class_hits(logits: torch.Tensor, labels: torch.Tensor, groups=()) -> torch.Tensor:
    """Bool (B, M): top-1, top-5 [and the group of classes, BENCHMARK.CLASS_GROUPS] right, of
    ``logits`` (B, C) against ``labels`` (B,)."""
    hits = common.topk_correct(logits, labels)
    if groups:
        hits = torch.cat([hits, common.grouped_correct(logits, labels, groups)[:, None]], dim=1)
    return hits
