"""What every picture of ``tools/look.py`` reads: the run's config turned into a one-process
feature extractor, and the embedded sample of images.

The run's resolved ``config.yaml`` is loaded with the command's overrides on top; the trunk is the
run's latest checkpoint (the student's network, or ``BENCHMARK.WEIGHTS_FROM=teacher``), frozen, on
one device (``MACHINE.DEVICE``), unsharded. The images are ``LOOK.MAX_IMAGES`` of
``DATA.<LOOK.SPLIT>``, evenly spaced over it, read with DATA.TEST's transform (the one the kNN
monitor and the benchmarks score with); their features are ``LOOK.FEATURE`` pooled as the
benchmarks pool it (``BENCHMARK.POOL_SIZE``, ``BENCHMARK.FEATURE_VIEWS``).
"""

import os
import re
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch
from torch import nn

from vistrain.benchmarks import common
from vistrain.benchmarks.eval_pictures import class_names
from vistrain.benchmarks.extract_features import Progress
from vistrain.checkpoint import find_latest_checkpoint
from vistrain.config import ConfigError, InputError
from vistrain.config.checks import check_plain_values
from vistrain.config.defaults import get_defaults
from vistrain.data.datasets import count_samples
from vistrain.distributed.launch import resolve_device
from vistrain.methods import build_meta_model, load_config
from vistrain.models.trunks import TokenLayout, token_layout, trunk_feature_names
from vistrain.runtime.logger import logger
from vistrain.runtime.pictures import as_rgb, example_indices, view_pixels
from vistrain.runtime.precision import amp_dtype


def run_config(run_dir: str, overrides: Sequence[str] = (), data: str = ""):
    """The look's config of the run folder ``run_dir``: its ``config.yaml``, then ``overrides``
    (``config.A.B=V`` items), checked as an ``extract_features`` job of the trunk alone, the run's
    latest checkpoint (unless an override names ``MODEL.WEIGHTS_INIT``), unsharded. ``data``:
    "train", "test" (LOOK.SPLIT) or a folder of images read as DATA.<LOOK.SPLIT> (disk_folder:
    labelled by class subfolders when it has them). One-line InputError for a folder that is no
    run folder or a LOOK value that cannot work."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise InputError(f"{run_dir} holds no config.yaml: give the folder of a run (its CHECKPOINT.DIR)")
    cfg = load_config([f"config={path}", *overrides])
    cfg.defrost()
    cfg.CHECKPOINT.DIR = run_dir  # where the run is now, whatever it was called when it ran
    if not any(item.startswith("config.MODEL.WEIGHTS_INIT.") for item in overrides):
        cfg.MODEL.WEIGHTS_INIT = get_defaults().MODEL.WEIGHTS_INIT.clone()  # not the run's own start
        cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = run_dir  # its latest checkpoint
        cfg.MODEL.WEIGHTS_INIT.SKIP_LAYERS = ["head."]  # the trunk's weights, as the benchmarks read them
    cfg.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP = False  # one process: a plain frozen trunk
    cfg.MODEL.HEAD.NAME = "identity"  # the trunk alone
    _images(cfg, data)
    cfg.LOOK.FEATURE = _feature(cfg)
    cfg.BENCHMARK.FEATURES = list(dict.fromkeys([cfg.LOOK.FEATURE, *maps_drawn(cfg.MODEL)]))
    cfg.JOB, cfg.BENCHMARK.EXTRACT_SPLITS = "extract_features", [cfg.LOOK.SPLIT]  # checked as that job
    cfg.freeze()
    check_plain_values(cfg)
    return cfg


def _images(cfg, data: str) -> None:
    """DATA.<LOOK.SPLIT> (``data``: see :func:`run_config`) read like DATA.TEST: its transform and
    batch size, in order, nothing dropped."""
    if data.lower() in ("train", "test"):
        cfg.LOOK.SPLIT = data.upper()
    read = cfg.DATA[cfg.LOOK.SPLIT]
    if data and data.lower() not in ("train", "test"):
        read.DATA_SOURCES, read.DATA_PATHS, read.DATA_LIMIT = ["disk_folder"], [data], -1
    read.TRANSFORMS = cfg.DATA.TEST.TRANSFORMS.clone()
    read.BATCHSIZE_PER_REPLICA = cfg.DATA.TEST.BATCHSIZE_PER_REPLICA
    read.SHUFFLE = read.DROP_LAST = False


def _feature(cfg) -> str:
    """LOOK.FEATURE, or MONITOR.FEATURE, or the first of MODEL.TRUNK.OUT_FEATURES; ConfigError
    (one line) when the trunk does not offer it."""
    feature = cfg.LOOK.FEATURE or cfg.MONITOR.FEATURE or cfg.MODEL.TRUNK.OUT_FEATURES[0]
    try:
        offered = trunk_feature_names(cfg.MODEL.TRUNK)
    except ValueError as error:  # an impossible trunk, in one line
        raise ConfigError(str(error)) from None
    if any(part not in offered for part, _ in common.feature_parts(feature, 1)):
        raise ConfigError(
            f"LOOK.FEATURE {feature!r} is not a feature of MODEL.TRUNK; valid: {', '.join(offered)}"
        )
    return feature


def maps_drawn(model_cfg) -> List[str]:
    """The maps the attention picture reads: none for a ViT (its attention is caught on the way),
    a CNN's :func:`spatial_maps`."""
    return [] if isinstance(token_layout(model_cfg.TRUNK), TokenLayout) else spatial_maps(model_cfg)


def spatial_maps(model_cfg) -> List[str]:
    """The trunk's (N, C, h, w) features (a CNN's stem and stages), shallow to deep, from a
    meta-device build."""
    trunk = build_meta_model(model_cfg).trunk
    vectors = set(getattr(trunk, "vector_features", ("avgpool",))) | {"sequence"}
    return [name for name in trunk.feature_dims if name not in vectors]


def checkpoint_iteration(cfg) -> int:
    """The iteration of the checkpoint looked at (0 when it is not one of the run's)."""
    weights = cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE
    latest = find_latest_checkpoint(weights) if os.path.isdir(weights) else None
    match = re.search(r"checkpoint_(\d+)$", latest or weights.rstrip("/"))
    return int(match.group(1)) if match else 0


@dataclass
class Sample:
    """The embedded images: row r is data set index ``indices[r]`` of ``dataset`` (the split read
    with the eval transform), labels -1 where there are none."""

    features: torch.Tensor  # (N, D) float32, on the CPU
    labels: torch.Tensor  # (N,) int64
    indices: torch.Tensor  # (N,) int64
    paths: List[str]
    dataset: object
    class_names: Sequence[str]
    total: int  # images of the split (N of them embedded)

    @property
    def labelled(self) -> bool:
        return bool((self.labels >= 0).all())

    def examples(self, count: int) -> List[int]:
        """``count`` rows: the first image of each class in turn (labelled), else evenly spaced."""
        if self.labelled:
            return example_indices(self.labels.tolist(), count)
        return np.linspace(0, len(self.paths) - 1, min(count, len(self.paths))).round().astype(int).tolist()

    def pixels(self, row: int) -> np.ndarray:
        """Row ``row``'s image as the trunk saw it, for display: uint8 (h, w, 3)."""
        return as_rgb(view_pixels(self.dataset, int(self.indices[row])))

    def label(self, row: int) -> str:
        """Row ``row``'s class name ("" without a label)."""
        label = int(self.labels[row])
        if label < 0:
            return ""
        return str(self.class_names[label]) if label < len(self.class_names) else str(label)


def device_of(cfg) -> torch.device:
    return torch.device(resolve_device(cfg.MACHINE))


def embed(cfg, trunk: nn.Module, device: torch.device) -> Sample:
    """Embed ``LOOK.MAX_IMAGES`` images of DATA.<LOOK.SPLIT>, evenly spaced (all when fewer)."""
    data, split = cfg.DATA, cfg.LOOK.SPLIT
    total = count_samples(data[split])
    count = min(total, cfg.LOOK.MAX_IMAGES)
    chosen = None if count == total else torch.linspace(0, total - 1, count).round().long().unique().tolist()
    loader = common.ordered_loader(data, split, cfg.SEED_VALUE, device, chosen)
    logger.info(f"embedding {count} of the {total} images of DATA.{split} ({cfg.LOOK.FEATURE})")
    progress = Progress(f"embed {split}", len(loader), len(loader.dataset))
    batches = (
        (images, batch["label"], batch["index"])
        for images, batch in progress.over(common.one_view_batches(loader, device))
    )
    bench = cfg.BENCHMARK
    feats, labels, indices = common.extract_batches(
        trunk, batches, [cfg.LOOK.FEATURE], bench.POOL_SIZE, amp_dtype(cfg.MODEL), device, bench.FEATURE_VIEWS
    )
    order = indices.argsort()
    dataset = getattr(loader.dataset, "dataset", loader.dataset)  # an IndexSubset's parent
    rows = indices[order].cpu()
    return Sample(
        features=feats[cfg.LOOK.FEATURE][order].float().cpu(),
        labels=labels[order].cpu(),
        indices=rows,
        paths=[dataset.describe(i) for i in rows.tolist()],
        dataset=dataset,
        class_names=class_names(dataset) or [str(c) for c in range(int(labels.max()) + 1)],
        total=total,
    )
