"""Engines: what one rank runs (``ENGINE_NAME``). Training loop, checkpoints, logging, parallel wrapping."""

from typing import Callable, Dict

from vistrain.benchmarks import extract_features, knn, linear_eval
from vistrain.config import ConfigError
from vistrain.engine.trainer import train

# ENGINE_NAME -> function(cfg) run on every rank by vistrain.distributed.launch
ENGINES: Dict[str, Callable] = {
    "train": train,
    "linear_eval": linear_eval,
    "knn": knn,
    "extract_features": extract_features,
}


def get_engine(name: str) -> Callable:
    """The engine function for ``ENGINE_NAME``; ConfigError listing the valid names otherwise."""
    if name not in ENGINES:
        raise ConfigError(f"unknown ENGINE_NAME {name!r}; valid: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


__all__ = ["ENGINES", "get_engine", "train"]
