"""The jobs a run can perform, picked by ``ENGINE_NAME`` (VISSL's name for it).

The top layer: it imports the training loop and the benchmarks, and nothing imports it except the
entry scripts in ``tools/``. (Three things are easy to confuse: the *sharded engine* is
``vistrain.fsdp``; a *job* is what one rank runs, chosen here; ``ENGINE_NAME`` is the config key.)
"""

from typing import Callable, Dict

from vistrain.benchmarks import extract_features, knn, linear_eval
from vistrain.config import ConfigError
from vistrain.training import train

# ENGINE_NAME -> function(cfg) run on every rank by vistrain.distributed.launch
JOBS: Dict[str, Callable] = {
    "train": train,
    "linear_eval": linear_eval,
    "knn": knn,
    "extract_features": extract_features,
}


def get_job(name: str) -> Callable:
    """The job function for ``ENGINE_NAME``; ConfigError listing the valid names otherwise."""
    if name not in JOBS:
        raise ConfigError(f"unknown ENGINE_NAME {name!r}; valid: {', '.join(sorted(JOBS))}")
    return JOBS[name]


__all__ = ["JOBS", "get_job"]
