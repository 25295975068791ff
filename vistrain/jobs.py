"""The jobs a run can perform, picked by the config key ``JOB`` (VISSL's ``ENGINE_NAME``).

The top layer: it imports the training loop and the benchmarks, and nothing imports it except the
command line (``vistrain.cli``, ``tools/``). It also hands the config layer the live registries
that values are checked against (:func:`catalog`).
"""

import os
from typing import Callable, Dict, Optional, Sequence

import torch
from fvcore.common.config import CfgNode

from vistrain.benchmarks import extract_features, finetune, knn, linear_eval
from vistrain.benchmarks.common import FEATURE_VIEWS
from vistrain.benchmarks.precise_bn import TRUNK_BN_STATS
from vistrain.benchmarks.weights import WEIGHTS_FROM
from vistrain.checkpoint.files import CheckpointError
from vistrain.checkpoint.pretrained import check_weights_file
from vistrain.config import ConfigError, InputError
from vistrain.config.checks import Catalog
from vistrain.data.datasets import SOURCES, count_samples
from vistrain.data.transforms import TRANSFORMS
from vistrain.distributed.launch import planned_world_size
from vistrain.methods import HEADS, METHODS, build_meta_model, check_config, load_config
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


def check_values(cfg) -> None:
    """Every value of ``cfg`` against the config's table of allowed values, the methods' rules and
    the run's method's checks; ConfigError (one line)."""
    check_config(cfg, catalog())


def checked_config(argv: Sequence[str]) -> CfgNode:
    """The run's config of ``argv`` (every method's keys too: ``vistrain.methods.load_config``),
    every value checked (:func:`check_values`): ConfigError (one line) for the first problem."""
    cfg = load_config(argv)
    check_values(cfg)
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
                trunk(torch.empty(2, 3, side, side, device="meta"))
    except InputError as error:
        return str(error)
    return None


__all__ = ["JOBS", "catalog", "check_values", "checked_config", "get_job"]
