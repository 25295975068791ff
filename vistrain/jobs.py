"""The jobs a run can perform, picked by the config key ``JOB`` (VISSL's ``ENGINE_NAME``).

The top layer: it imports the training loop and the benchmarks, and nothing imports it except the
command line (``vistrain.cli``, ``tools/``). It also hands the config layer the live registries
that values are checked against (:func:`catalog`).
"""

import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from fvcore.common.config import CfgNode

from vistrain.benchmarks import extract_features, finetune, knn, linear_eval
from vistrain.benchmarks.common import FEATURE_VIEWS
from vistrain.benchmarks.precise_bn import TRUNK_BN_STATS
from vistrain.benchmarks.weights import WEIGHTS_FROM
from vistrain.checkpoint.files import CheckpointError, find_latest_checkpoint, read_metadata
from vistrain.checkpoint.identity import check_same_results, check_same_run
from vistrain.checkpoint.pretrained import check_weights_file
from vistrain.config import ConfigError, InputError
from vistrain.config.checks import Catalog
from vistrain.config.warmups import fit_warmups
from vistrain.data.datasets import SOURCES, count_samples
from vistrain.data.loader import image_statistics, statistics_line
from vistrain.data.sampler import samples_per_rank
from vistrain.data.transforms import TRANSFORMS
from vistrain.distributed.launch import planned_world_size
from vistrain.methods import HEADS, METHODS, build_meta_model, check_config, load_config, method_warmups
from vistrain.models.trunks import TRUNKS, trunk_feature_names
from vistrain.optim import OPTIMIZERS
from vistrain.optim.schedulers import SCHEDULES
from vistrain.runtime.precision import AMP_DTYPES, DTYPES
from vistrain.runtime.sharding import BACKENDS
from vistrain.training import train

# JOB -> function(cfg) run on every rank by vistrain.distributed.launch
JOBS: Dict[str, Callable] = {
    "train": train,
    "linear_eval": linear_eval,
    "knn": knn,
    "finetune": finetune,
    "extract_features": extract_features,
}


def get_job(name: str) -> Callable:
    """The job function for ``JOB``; ConfigError listing the valid names otherwise."""
    if name not in JOBS:
        raise ConfigError(f"unknown JOB {name!r}; valid: {', '.join(sorted(JOBS))}")
    return JOBS[name]


def catalog() -> Catalog:
    """The live registries and probes that ``vistrain.config.checks`` checks values against."""
    registries = {
        "jobs": JOBS,
        "optimizers": OPTIMIZERS,
        "lr schedules": SCHEDULES,
        "losses": METHODS,
        "trunks": TRUNKS,
        **{key: names for fam in TRUNKS.values() for key, names in fam.names.items()},  # "regnets"...
        "heads": HEADS,
        "data sources": SOURCES,
        "transforms": TRANSFORMS,
        "sharding backends": BACKENDS,
        "compute dtypes": DTYPES,
        "amp dtypes": AMP_DTYPES,
        "feature views": FEATURE_VIEWS,
        "trunk BN statistics": TRUNK_BN_STATS,
        "checkpoint networks": WEIGHTS_FROM,
    }
    return Catalog(
        names={key: sorted(names) for key, names in registries.items()},
        weights_problem=_weights_problem,
        trunk_features=trunk_feature_names,
        model_problem=_model_problem,
        num_samples=count_samples,
        world_size=lambda cfg: planned_world_size(cfg.DISTRIBUTED, os.environ),
    )


def check_values(cfg, files: bool = True) -> None:
    """Every value of ``cfg`` against the config's table of allowed values, the methods' rules and
    the run's method's checks; ConfigError (one line). ``files=False``: not the data, run folder
    or weights file (the planner's check)."""
    check_config(cfg, catalog(), files)


def training_samples(cfg) -> Optional[int]:
    """The samples of a training run's DATA.TRAIN (counted, not read); None for other jobs."""
    return count_samples(cfg.DATA.TRAIN) if cfg.JOB == "train" else None


def iterations_per_epoch(cfg, samples: Optional[int]) -> Optional[int]:
    """A training run's iterations per epoch on ``samples`` (:func:`training_samples`), as its
    loader will count them over the job's ranks and batches; None for other jobs."""
    if samples is None:
        return None
    split = cfg.DATA.TRAIN
    world = planned_world_size(cfg.DISTRIBUTED, os.environ)
    per_rank = samples_per_rank(samples, world, split.BATCHSIZE_PER_REPLICA, split.DROP_LAST)
    return -(-per_rank // split.BATCHSIZE_PER_REPLICA)


def fitted_warmups(cfg, samples: Optional[int]) -> Tuple[CfgNode, Optional[str]]:
    """``vistrain.config.warmups.fit_warmups`` with the run's method's warm-ups
    (``Method.warmups``) and its iterations per epoch: the config a short run trains, and the
    one-line note when a warm-up was shortened."""
    return fit_warmups(cfg, method_warmups(cfg), iterations_per_epoch(cfg, samples))


def normalized_config(cfg) -> Tuple[CfgNode, Optional[str]]:
    """With ``DATA.NORMALIZE_FROM_IMAGES``: the config whose splits normalise with the mean and std
    of DATA.TRAIN's images, computed here once (the key set back to 0, so that the ranks and the
    saved config.yaml hold the values), and the line that says so; else ``cfg`` and None."""
    if cfg.DATA.NORMALIZE_FROM_IMAGES <= 0:
        return cfg, None
    mean, std, count = image_statistics(cfg.DATA)
    out = cfg.clone()
    out.defrost()
    for split in ("TRAIN", "TEST"):
        out.DATA[split].TRANSFORMS.MEAN, out.DATA[split].TRANSFORMS.STD = list(mean), list(std)
    out.DATA.NORMALIZE_FROM_IMAGES = 0
    out.freeze()
    return out, statistics_line(mean, std, count)


def check_run_folder(cfg, samples: Optional[int]) -> None:
    """``CHECKPOINT.DIR`` holds nothing the job would mix with or overwrite: for a training run no
    other run (other data, method, model or schedule); for an evaluation no other job's or
    evaluation's results (its ``config.yaml``). ``vistrain.checkpoint.identity.OtherRunError``,
    one line naming a free folder, otherwise. ``samples``: :func:`training_samples`. Called before
    the ranks start (the ranks check a training run's folder again when they resume)."""
    recorded = os.path.join(cfg.CHECKPOINT.DIR, "config.yaml")
    if os.path.isfile(recorded):
        with open(recorded) as f:
            check_same_results(cfg.CHECKPOINT.DIR, f.read(), cfg)
    if samples is None:
        return
    latest = find_latest_checkpoint(cfg.CHECKPOINT.DIR)
    if latest is not None:
        world = planned_world_size(cfg.DISTRIBUTED, os.environ)
        check_same_run(cfg.CHECKPOINT.DIR, read_metadata(latest), cfg, samples, world_size=world)


def checked_config(argv: Sequence[str], files: bool = True) -> CfgNode:
    """The run's config of ``argv`` (every method's keys too: ``vistrain.methods.load_config``),
    every value checked (:func:`check_values`; ``files=False``: not those of the file system):
    ConfigError (one line) for the first problem."""
    cfg = load_config(argv)
    check_values(cfg, files)
    return cfg


def _weights_problem(path: str) -> Optional[str]:
    try:
        check_weights_file(path)
    except (CheckpointError, FileNotFoundError) as error:
        return f"cannot be loaded: {error}"
    return None


def _model_problem(cfg) -> Optional[str]:
    try:
        trunk = build_meta_model(cfg.MODEL).trunk
        with torch.no_grad():  # one batch per crop side (2 images: BatchNorm refuses one)
            for side in sorted(set(cfg.DATA.TRAIN.TRANSFORMS.SIZE_CROPS)):
                trunk(torch.empty(2, cfg.MODEL.TRUNK.IN_CHANNELS, side, side, device="meta"))
    except InputError as error:
        return str(error)
    return None


__all__ = [
    "JOBS",
    "catalog",
    "check_run_folder",
    "check_values",
    "checked_config",
    "fitted_warmups",
    "get_job",
    "iterations_per_epoch",
    "training_samples",
]
