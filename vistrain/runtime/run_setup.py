"""The start every job (train, linear_eval, knn, finetune, extract_features) shares, on every rank."""

import os
import random
import uuid

import numpy as np
import torch

from vistrain.checkpoint.files import fsync_dir
from vistrain.config import save_config
from vistrain.config.words import plural
from vistrain.distributed import comm
from vistrain.distributed.launch import resolve_device
from vistrain.runtime import provenance
from vistrain.runtime.host_memory import set_mmap_threshold
from vistrain.runtime.logger import logger, setup_logging


def start_run(cfg) -> torch.device:
    """Log to ``CHECKPOINT.DIR``, seed, return the device. (The config is recorded by
    :func:`record_config` only once the job really starts working.)

    Every rank uses the same seed: identical initial weights (DDP and the sharded engine also
    broadcast them); the data layer derives per-rank orders and augmentations from it itself.
    """
    run_dir = cfg.CHECKPOINT.DIR
    setup_logging(run_dir)
    device = resolve_device(cfg.MACHINE)
    if device == "cpu":
        set_mmap_threshold(cfg.MACHINE.CPU_MMAP_THRESHOLD_MIB)
    check_run_dir_is_shared(run_dir)
    logger.info(f"{plural(comm.get_world_size(), 'rank')} on {device}: building the model, reading the data")
    random.seed(cfg.SEED_VALUE)
    np.random.seed(cfg.SEED_VALUE)
    torch.manual_seed(cfg.SEED_VALUE)
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # set per local rank by launch
    return torch.device("cpu")


def record_config(cfg, trained_until: int = 0) -> str:
    """Rank 0: write ``CHECKPOINT.DIR/config.yaml`` now that the job really starts, and add this
    launch to ``provenance.json`` (:mod:`vistrain.runtime.provenance`); returns the config's path.

    Called only once a run is past every check and resume, so runs that fail early or find nothing
    to do never replace the record. A previous, different ``config.yaml`` describes what trained
    the checkpoints up to iteration ``trained_until`` (the one this run resumed from; 0 when none):
    it is kept as ``config.<trained_until>.yaml`` (``config.<trained_until>.2.yaml``... if taken).
    """
    path = os.path.join(cfg.CHECKPOINT.DIR, "config.yaml")
    if not comm.is_main_process():
        return path
    device = torch.device(resolve_device(cfg.MACHINE))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    provenance.append_record(cfg.CHECKPOINT.DIR, provenance.launch_record(cfg.JOB, device, trained_until))
    if os.path.isfile(path):
        with open(path) as f:
            previous = f.read()
        if previous == cfg.dump():
            return path
        os.replace(path, _free_name(cfg.CHECKPOINT.DIR, f"config.{trained_until}"))
        fsync_dir(cfg.CHECKPOINT.DIR)
    save_config(cfg, path)
    return path


def _free_name(folder: str, stem: str) -> str:
    candidate, n = os.path.join(folder, f"{stem}.yaml"), 1
    while os.path.exists(candidate):
        n += 1
        candidate = os.path.join(folder, f"{stem}.{n}.yaml")
    return candidate


def check_run_dir_is_shared(run_dir: str) -> None:
    """Collective: fail on every rank unless all ranks see the same ``run_dir``.

    Every rank writes its checkpoint shard there and rank 0 publishes the folder, so a
    node-local ``CHECKPOINT.DIR`` would only fail at the first save (or resume from a partial
    view). Rank 0 creates a probe file with a fresh name; every rank must find it.
    """
    if comm.get_world_size() == 1:
        return
    name = comm.all_gather_object(f".shared-check-{uuid.uuid4().hex}")[0]  # rank 0's fresh name
    probe = os.path.join(run_dir, name)  # the same path on every node when the folder is shared
    if comm.is_main_process():
        os.makedirs(run_dir, exist_ok=True)
        open(probe, "w").close()
    comm.barrier()
    blind = [rank for rank, seen in enumerate(comm.all_gather_object(os.path.exists(probe))) if not seen]
    if comm.is_main_process():
        os.remove(probe)
    if blind:
        raise RuntimeError(
            f"CHECKPOINT.DIR {run_dir} is not shared: ranks {blind} do not see what rank 0 writes there; "
            f"use a folder on a file system every node mounts at the same path"
        )
