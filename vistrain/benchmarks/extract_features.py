"""Write a frozen trunk's features to disk: ``extract_features(cfg)`` (``JOB: extract_features``).

For every split in ``BENCHMARK.EXTRACT_SPLITS`` the pooled features of ``BENCHMARK.FEATURES``
(see :func:`vistrain.benchmarks.common.trunk_features`) go to ``BENCHMARK.OUTPUT_DIR`` (default
``CHECKPOINT.DIR/features``):

    <split>_rank<r>.pt   this rank's samples, in its loader order (padding repeats included)
    <split>.pt           rank 0: every sample once, sorted by data set index

Each file is ``torch.save`` of ``{"features": {name: float32 (N, D)}, "label": int64 (N,),
"index": int64 (N,), "split": "train" | "test"}``; read it with ``torch.load(path)``. Labels may be
-1 for unlabelled data (extraction does not need labels). The merged file is built from the
ranks' tensors by a collective, so the ranks need no shared file system.
"""

import os

import torch

from vistrain.benchmarks import common
from vistrain.data import build_loader
from vistrain.distributed import comm
from vistrain.runtime.logger import logger
from vistrain.runtime.precision import amp_dtype
from vistrain.runtime.run_setup import record_config, start_run


def extract_features(cfg) -> None:
    """Extract BENCHMARK.FEATURES of every BENCHMARK.EXTRACT_SPLITS split; see the module docstring."""
    splits = list(cfg.BENCHMARK.EXTRACT_SPLITS)
    run_dir = cfg.CHECKPOINT.DIR
    out_dir = cfg.BENCHMARK.OUTPUT_DIR or os.path.join(run_dir, "features")
    device = start_run(cfg)
    os.makedirs(out_dir, exist_ok=True)

    trunk, dims = common.build_frozen_trunk(cfg, device)
    record_config(cfg)  # built and loaded: the job really starts
    names, dtype = list(dims), amp_dtype(cfg.MODEL)
    for split in splits:
        loader = build_loader(cfg.DATA, split, seed=cfg.SEED_VALUE, device=device)
        features, labels, indices = common.extract(
            trunk, loader, names, cfg.BENCHMARK.POOL_SIZE, dtype, device, cfg.BENCHMARK.FEATURE_VIEWS
        )
        mine = {"features": features, "label": labels, "index": indices, "split": split.lower()}
        torch.save(_to_cpu(mine), os.path.join(out_dir, f"{split.lower()}_rank{comm.get_rank()}.pt"))
        merged = merge(mine)  # collective
        if comm.is_main_process():
            path = os.path.join(out_dir, f"{split.lower()}.pt")
            torch.save(_to_cpu(merged), path)
            shapes = {name: tuple(t.shape) for name, t in merged["features"].items()}
            logger.info(f"wrote {path}: {shapes}")


def merge(part: dict) -> dict:
    """Collective: every rank's part -> the whole split, each index once, sorted by index."""
    names = list(part["features"])
    indices, tensors = common.gather_unique(
        part["index"], part["label"], *(part["features"][n] for n in names)
    )
    return {
        "features": dict(zip(names, tensors[1:])),
        "label": tensors[0],
        "index": indices,
        "split": part["split"],
    }


def _to_cpu(record: dict) -> dict:
    return {
        "features": {name: t.cpu() for name, t in record["features"].items()},
        "label": record["label"].cpu(),
        "index": record["index"].cpu(),
        "split": record["split"],
    }
