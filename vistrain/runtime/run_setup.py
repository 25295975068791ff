"""The start every job (train, linear_eval, knn, extract_features) shares, on every rank."""

import os
import random

import numpy as np
import torch

from vistrain.config import save_config
from vistrain.distributed import comm
from vistrain.distributed.launch import resolve_device
from vistrain.runtime.logger import setup_logging


def start_run(cfg) -> torch.device:
    """Log to ``CHECKPOINT.DIR``, save the resolved config there (rank 0), seed, return the device.

    Every rank uses the same seed: identical initial weights (DDP and the sharded engine also
    broadcast them); the data layer derives per-rank orders and augmentations from it itself.
    """
    run_dir = cfg.CHECKPOINT.DIR
    setup_logging(run_dir)
    if comm.is_main_process():
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
    random.seed(cfg.SEED_VALUE)
    np.random.seed(cfg.SEED_VALUE)
    torch.manual_seed(cfg.SEED_VALUE)
    if resolve_device(cfg.MACHINE) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # set per local rank by launch
    return torch.device("cpu")
