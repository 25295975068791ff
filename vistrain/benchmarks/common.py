"""What every benchmark shares: the frozen trunk, its pooled features, labels, and exact counting
over ranks whose data was padded.

The trunk is built from ``cfg.MODEL`` with the "identity" head, so it returns the feature dict of
``BENCHMARK.FEATURES``; pretrained weights come from ``MODEL.WEIGHTS_INIT`` (any checkpoint
format, the student's or the teacher's network: :mod:`vistrain.benchmarks.weights`). It is then frozen: ``requires_grad``
False, eval mode (BatchNorm uses and keeps its running statistics: those of the checkpoint, or
recomputed on DATA.TRAIN with ``BENCHMARK.TRUNK_BN_STATS: recompute``), every forward under
``no_grad``. With ``MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP`` it is sharded by our engine, which under
``no_grad`` gathers each unit's weights for its forward and frees them right after, so a trunk
larger than one device's memory can be evaluated. Without it every rank holds a plain copy (DDP
refuses a module with nothing to train, and a frozen trunk has no gradients to synchronise).
"""

import json
import os
from typing import Dict, Iterable, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks.precise_bn import recompute_bn_statistics
from vistrain.benchmarks.weights import load_weights
from vistrain.config.errors import DataError
from vistrain.config.words import plural
from vistrain.data import build_loader, set_epoch
from vistrain.distributed import comm
from vistrain.methods import build_model
from vistrain.runtime.logger import logger
from vistrain.runtime.precision import amp_dtype
from vistrain.runtime.sharding import shard_model

# --------------------------------------------------------------------------------------------
# the frozen trunk


def feature_parts(name: str, pool_size: int) -> List[Tuple[str, int]]:
    """The trunk features a BENCHMARK.FEATURES entry reads, with the side each is pooled to:
    ``"s2"`` -> [("s2", pool_size)]; ``"s2@4"`` -> [("s2", 4)] (this part pooled to 4 x 4 instead of
    BENCHMARK.POOL_SIZE); several joined by "+" (``"s2@4+s3+avgpool"``) are each pooled, then
    concatenated in that order, as DINO's linear evaluation concatenates the outputs of several
    blocks. "avgpool" is already (N, C): its side is 1."""
    parts = []
    for part in name.split("+"):
        feature, _, side = part.partition("@")
        parts.append((feature, 1 if feature == "avgpool" else int(side or pool_size)))
    return parts


def trunk_model_config(cfg):
    """``cfg.MODEL`` for a frozen feature extractor: identity head returning every trunk feature
    BENCHMARK.FEATURES reads."""
    model_cfg = cfg.MODEL.clone()
    model_cfg.defrost()
    model_cfg.HEAD.NAME = "identity"
    parts = [part for name in cfg.BENCHMARK.FEATURES for part, _ in feature_parts(name, 1)]
    model_cfg.TRUNK.OUT_FEATURES = list(dict.fromkeys(parts))
    model_cfg.freeze()
    return model_cfg


def heads_model_config(model_cfg):
    """``model_cfg`` (the MODEL section) for the probe heads: their BatchNorm always standardises
    over the global batch, whatever the trunk trained with, so the probe reads the same on any
    number of ranks (a per-rank BatchNorm would see 1/world of each batch)."""
    heads_cfg = model_cfg.clone()
    heads_cfg.defrost()
    heads_cfg.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN = True
    heads_cfg.SYNC_BN_CONFIG.GROUP_SIZE = 0
    heads_cfg.freeze()
    return heads_cfg


def build_frozen_trunk(cfg, device: torch.device) -> Tuple[nn.Module, Dict[str, int]]:
    """The trunk of ``cfg.MODEL`` with ``MODEL.WEIGHTS_INIT`` loaded, frozen, on ``device``.

    ``BENCHMARK.TRUNK_BN_STATS: recompute`` first recomputes its BatchNorm statistics on DATA.TRAIN
    (:mod:`vistrain.benchmarks.precise_bn`; collective).

    Returns (module, dims): the module maps images (N, 3, H, W) to ``{name: feature}`` for
    BENCHMARK.FEATURES (sharded by our engine with AUTO_SETUP_FSDP, else plain; call it only under
    ``no_grad``); dims gives each feature's width after :func:`pool_feature`.
    """
    pool_size = cfg.BENCHMARK.POOL_SIZE
    model_cfg = trunk_model_config(cfg)
    model = build_model(model_cfg)
    vectors = getattr(model.trunk, "vector_features", ("avgpool",))
    dims = pooled_dims(model.trunk.feature_dims, cfg.BENCHMARK.FEATURES, pool_size, vectors)
    load_weights(model, cfg.MODEL.WEIGHTS_INIT, cfg.BENCHMARK.WEIGHTS_FROM)
    for param in model.parameters():
        param.requires_grad_(False)  # before sharding: the engine then builds gradient-free shards
    model = model.to(device)
    if cfg.BENCHMARK.TRUNK_BN_STATS == "recompute":  # before sharding: a plain forward per pass
        loader = ordered_loader(cfg.DATA, "TRAIN", cfg.SEED_VALUE, device)
        model = recompute_bn_statistics(
            model, view_batches(loader, device, cfg.BENCHMARK.FEATURE_VIEWS), amp_dtype(cfg.MODEL)
        )
    if model_cfg.FSDP_CONFIG.AUTO_SETUP_FSDP:
        # sharding only: in eval mode BatchNorm reads its running statistics (nothing to
        # synchronise) and no backward recomputes activations
        model = shard_model(model, model_cfg)
    return model.eval(), dims


# BENCHMARK.FEATURE_VIEWS -> the image transforms whose features are averaged: (quarter turns, flip)
FEATURE_VIEWS = {
    "identity": [(0, False)],
    "flip": [(0, False), (0, True)],
    "dihedral": [(turns, flip) for turns in range(4) for flip in (False, True)],
}


def view_of(images: torch.Tensor, turns: int, flip: bool) -> torch.Tensor:
    """(N, C, H, W) turned by ``turns`` quarter turns, then mirrored left-right when ``flip``."""
    turned = torch.rot90(images, turns, dims=(2, 3)) if turns else images
    return turned.flip(3) if flip else turned


@torch.no_grad()
def trunk_features(
    trunk: nn.Module,
    images: torch.Tensor,
    names: Sequence[str],
    pool_size: int,
    dtype=None,
    views: str = "identity",
) -> Dict[str, torch.Tensor]:
    """Pooled float32 features ``{name: (N, D_name)}`` of ``images`` (N, 3, H, W) from the frozen trunk.

    Stage maps (N, C, h, w) are average-pooled to (N, C, P, P) with P = ``pool_size`` (or the
    name's ``@P``) and flattened to D = C * P * P (VISSL's linear-eval protocol); "avgpool" is
    already (N, C). A name joining several features by "+" gets their pooled features concatenated
    along D (:func:`feature_parts`). ``views`` (:data:`FEATURE_VIEWS`) averages the features of
    transformed copies of the images, f(x) = mean_g f(g x): for images with no "up" (cells, slides,
    satellite tiles) "dihedral" averages over the 8 symmetries of the square, so a feature no longer
    depends on which way an image was scanned.
    """
    transforms = FEATURE_VIEWS[views]
    total = None
    for turns, flip in transforms:
        out = _pooled(trunk, view_of(images, turns, flip), names, pool_size, dtype)
        total = out if total is None else {name: total[name] + out[name] for name in names}
    return {name: total[name] / len(transforms) for name in names}


def _pooled(trunk: nn.Module, images: torch.Tensor, names: Sequence[str], pool_size: int, dtype):
    with torch.autocast(images.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        out = trunk(images)

    def pooled(name: str) -> torch.Tensor:
        return torch.cat(
            [pool_feature(out[part], side).float() for part, side in feature_parts(name, pool_size)], 1
        )

    return {name: pooled(name) for name in names}


def pool_feature(feature: torch.Tensor, pool_size: int) -> torch.Tensor:
    """(N, C, h, w) -> (N, C * P * P) by adaptive average pooling; (N, C) unchanged."""
    if feature.dim() == 2:
        return feature
    return torch.flatten(F.adaptive_avg_pool2d(feature, pool_size), 1)


def pooled_dims(
    channels: Dict[str, int], names: Sequence[str], pool_size: int, vectors: Sequence[str] = ("avgpool",)
) -> Dict[str, int]:
    """Width of each pooled feature: C * P * P for stage maps (P: its ``@P`` or ``pool_size``), C for
    the (N, C) features ``vectors`` (a trunk's ``vector_features``, else "avgpool"), the sum of its
    parts' for a concatenation (``channels``: the trunk's ``feature_dims``)."""

    def width(part: str, side: int) -> int:
        return channels[part] * (1 if part in vectors else side**2)

    return {name: sum(width(part, side) for part, side in feature_parts(name, pool_size)) for name in names}


def ordered_loader(data_cfg, split: str, seed: int, device: torch.device, indices=None):
    """The loader of DATA.<split> (only its samples ``indices`` when given) in order, nothing
    dropped (padded to equal batches per rank)."""
    ordered = data_cfg.clone()
    ordered.defrost()
    ordered[split].SHUFFLE = ordered[split].DROP_LAST = False
    return build_loader(ordered, split, seed=seed, device=device, indices=indices)


def holdout_data_config(data_cfg):
    """DATA with TRAIN read like TEST (its transform and batch size, in order, nothing dropped):
    the held-out training images that choose an lr are scored as the test images are."""
    holdout = data_cfg.clone()
    holdout.defrost()
    holdout.TRAIN.TRANSFORMS = data_cfg.TEST.TRANSFORMS.clone()
    holdout.TRAIN.BATCHSIZE_PER_REPLICA = data_cfg.TEST.BATCHSIZE_PER_REPLICA
    holdout.TRAIN.SHUFFLE = holdout.TRAIN.DROP_LAST = False
    holdout.freeze()
    return holdout


def one_view_batches(loader, device: torch.device):
    """(images (N_r, 3, H, W) on ``device``, batch) of one pass of ``loader``; ValueError for a
    transform that makes several views per image."""
    set_epoch(loader, 0)
    for batch in loader:
        if len(batch["crops"]) != 1:
            raise ValueError(
                f"feature extraction takes one view per image, got {len(batch['crops'])}: use TRANSFORMS.NAME=eval"
            )
        yield batch["crops"][0].to(device), batch


def view_batches(loader, device: torch.device, views: str):
    """Each batch of one pass of ``loader`` under each transform of ``FEATURE_VIEWS[views]``:
    images (N_r, 3, H, W) on ``device``, len(loader) * len(transforms) of them."""
    for images, _ in one_view_batches(loader, device):
        for turns, flip in FEATURE_VIEWS[views]:
            yield view_of(images, turns, flip)


@torch.no_grad()
def extract(
    trunk: nn.Module,
    loader,
    names: Sequence[str],
    pool_size: int,
    dtype,
    device: torch.device,
    views: str = "identity",
) -> Tuple[Dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """This rank's pooled features ``{name: (N_r, D)}``, labels (N_r,) and indices (N_r,) of one
    pass (``views``: see :func:`trunk_features`)."""
    batches = ((images, batch["label"], batch["index"]) for images, batch in one_view_batches(loader, device))
    return extract_batches(trunk, batches, names, pool_size, dtype, device, views)


@torch.no_grad()
def extract_batches(
    trunk: nn.Module,
    batches: Iterable[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    names: Sequence[str],
    pool_size: int,
    dtype,
    device: torch.device,
    views: str = "identity",
) -> Tuple[Dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """:func:`extract` of ``batches``: (images (N_b, 3, H, W) on ``device``, labels (N_b,),
    indices (N_b,)) each, as :func:`one_view_batches` reads them (or a copy kept in memory)."""
    feats = {name: [] for name in names}
    labels, indices = [], []
    for images, batch_labels, batch_indices in batches:
        out = trunk_features(trunk, images, names, pool_size, dtype, views)
        for name in names:
            feats[name].append(out[name])
        labels.append(batch_labels.to(device))
        indices.append(batch_indices.to(device))
    return {name: torch.cat(feats[name]) for name in names}, torch.cat(labels), torch.cat(indices)


# --------------------------------------------------------------------------------------------
# labels


def check_labels(dataset, split: str) -> int:
    """Number of classes of a labelled ``dataset``; DataError (one line) when some images carry
    no label.

    A label is missing when it is negative (-1: a file list's unlabelled line, or a disk_folder
    read with FOLDER_LABELS none, e.g. a flat folder).
    """
    labels = torch.as_tensor(dataset.targets, dtype=torch.long)
    missing = int((labels < 0).sum())
    if missing:
        raise DataError(
            f"DATA.{split} has {missing} of {len(labels)} images without a label: evaluation needs labels; "
            f"put a disk_folder's images in class subfolders (<path>/<class>/<image>, DATA.{split}.FOLDER_LABELS "
            "subfolders) or list them with labels in a disk_filelist"
        )
    return int(labels.max()) + 1


def num_classes(train_dataset, test_dataset) -> int:
    """Classes of a labelled train/test pair (labels 0..C-1 of the training split)."""
    classes = check_labels(train_dataset, "TRAIN")
    test_classes = check_labels(test_dataset, "TEST")
    if test_classes > classes:
        raise ValueError(
            f"DATA.TEST has label {test_classes - 1} but DATA.TRAIN only labels 0..{classes - 1}; "
            "the two splits must share their classes"
        )
    return classes


# --------------------------------------------------------------------------------------------
# exact results over padded, distributed data


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (N_r, ...) along dim 0, in rank order; N_r may differ."""
    if comm.get_world_size() == 1:
        return tensor
    sizes = comm.all_gather_object(tensor.shape[0])
    padded = tensor.new_zeros((max(sizes),) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = comm.all_gather_no_grad(padded).view(len(sizes), max(sizes), *tensor.shape[1:])
    return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])


def first_occurrence(indices: torch.Tensor) -> torch.Tensor:
    """Bool mask (N,) of the first position of every distinct value of ``indices`` (N,) int64.

    The sampler pads the last batches by repeating samples, so counting each data set index once
    (its first appearance in rank order) gives exactly the single-process result.
    """
    order = torch.sort(indices, stable=True).indices
    ordered = indices[order]
    new_value = torch.ones_like(ordered, dtype=torch.bool)
    new_value[1:] = ordered[1:] != ordered[:-1]
    mask = torch.empty_like(new_value)
    mask[order] = new_value
    return mask


def gather_unique(indices: torch.Tensor, *tensors: torch.Tensor):
    """Collective: rows of every rank, each data set index once, sorted by index.

    ``indices`` (N_r,) int64 and each of ``tensors`` (N_r, ...) hold this rank's samples. Returns
    (indices (N,), [tensor (N, ...)...]), the same on all ranks and for any world size.
    """
    everything = gather_rows(indices)
    keep = first_occurrence(everything)
    order = everything[keep].argsort()
    return everything[keep][order], [gather_rows(t)[keep][order] for t in tensors]


def unique_on_this_rank(indices: torch.Tensor) -> torch.Tensor:
    """Collective: mask of this rank's samples (N_r,) that count (first occurrence over all ranks)."""
    sizes = comm.all_gather_object(indices.shape[0])
    start = sum(sizes[: comm.get_rank()])
    everything = gather_rows(indices)
    return first_occurrence(everything)[start : start + indices.shape[0]]


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: Sequence[int] = (1, 5)) -> torch.Tensor:
    """Bool (N, len(ks)): the label is among the ``k`` highest ``logits`` (N, C) (k capped at C)."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices  # (N, k_max)
    hits = top == labels[:, None]
    return torch.stack([hits[:, : min(k, k_max)].any(dim=1) for k in ks], dim=1)


# --------------------------------------------------------------------------------------------
# results


def write_metrics(run_dir: str, record: dict, name: str = "metrics.json") -> str:
    """Rank 0 writes ``record`` as JSON to ``run_dir/name`` (atomically). Returns the path."""
    path = os.path.join(run_dir, name)
    if comm.is_main_process():
        os.makedirs(run_dir, exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(f"{path}.tmp", path)
    return path


def log_accuracy_table(title: str, results: Dict[str, dict]) -> None:
    """One log line per feature: top-1 / top-5 in percent."""
    logger.info(title)
    for name, res in results.items():
        logger.info(
            f"  {name:>8}: top-1 {res['top1']:6.2f}%  top-5 {res['top5']:6.2f}%  ({plural(res['num_images'], 'image')})"
        )


def summarise(
    counts: torch.Tensor, names: List[str], metrics: Sequence[str] = ("top1", "top5")
) -> Dict[str, dict]:
    """counts (F, M + 1) float64 [hits of each of ``metrics``..., images], summed over ranks -> percentages."""
    out = {}
    for name, row in zip(names, counts.tolist()):
        *hits, total = row
        scale = 100.0 / max(total, 1.0)
        out[name] = {metric: h * scale for metric, h in zip(metrics, hits)}
        out[name]["num_images"] = int(total)
    return out


def grouped_correct(
    logits: torch.Tensor, labels: torch.Tensor, groups: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Bool (N,): the most probable group of classes is the label's group (``BENCHMARK.CLASS_GROUPS``).

    A group's probability is the sum of its classes' softmax probabilities over ``logits`` (N, C),
    e.g. ELPV's two-class protocol from its four-class probe: groups [[0, 1], [2, 3]] (functional,
    defective when p >= 0.5). Every class 0..C-1 must be in exactly one group.
    """
    group_of = torch.full((logits.shape[1],), -1, dtype=torch.long, device=logits.device)
    for g, members in enumerate(groups):
        group_of[list(members)] = g
    if (group_of < 0).any():
        raise ValueError(f"BENCHMARK.CLASS_GROUPS {groups} leaves out some of the {logits.shape[1]} classes")
    probs = logits.float().softmax(dim=1)
    grouped = torch.zeros(logits.shape[0], len(groups), device=logits.device).index_add_(1, group_of, probs)
    return grouped.argmax(dim=1) == group_of[labels]
