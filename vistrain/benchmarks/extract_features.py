"""Write a frozen trunk's embeddings to disk: ``extract_features(cfg)`` (``JOB: extract_features``).

The trunk is any family's (RegNet, ResNet, ViT, timm, torchvision), read from a run folder, a
checkpoint or an exported file (``MODEL.WEIGHTS_INIT``, :mod:`vistrain.benchmarks.weights`), the
student's network or the momentum teacher's (``BENCHMARK.WEIGHTS_FROM``); the images come from any
data source of ``DATA.<split>`` (labels -1 where there are none). For every split in
``BENCHMARK.EXTRACT_SPLITS`` the pooled features of each ``BENCHMARK.FEATURES`` name ``F`` (see
:func:`vistrain.benchmarks.common.trunk_features`) go to ``BENCHMARK.OUTPUT_DIR`` (default
``CHECKPOINT.DIR/features``), every sample once, in data set order (rank 0 writes; ``s`` is the
split in lower case):

    s.pt             torch.save of {"features": {F: float32 (N, D_F)}, "label": int64 (N,),
                     "index": int64 (N,), "path": [N str], "split", "weights", "network"}
    s_F.npy          float32 (N, D_F): numpy.load, row i is the image on line i of s_paths.txt
    s_labels.npy     int64 (N,)
    s_indices.npy    int64 (N,): each row's index in the data set
    s_paths.txt      N lines: each image's path (``<source>[i]`` for sources without files)
    s_F.parquet      columns path, label, index, embedding (fixed-size list of D_F float32), when
                     pyarrow is installed (``pip install "vistrain[parquet]"``)
    s_rank<r>.pt     rank r's samples in its loader order (padding repeats included)

The merged rows are gathered from the ranks by a collective (no shared file system needed), so any
number of ranks writes the same files. The log shows a progress bar with the images per second and
the time left.
"""

import datetime
import os
import time
from typing import Dict, List

import numpy as np
import torch

from vistrain.benchmarks import common
from vistrain.data import build_loader
from vistrain.distributed import comm
from vistrain.runtime.logger import logger
from vistrain.runtime.precision import amp_dtype
from vistrain.runtime.run_setup import record_config, start_run

BAR = 20  # characters of the progress bar
LOG_EVERY_SECONDS = 10.0  # at most one progress line per this many seconds (and the last one)


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
    source = {"weights": cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE, "network": cfg.BENCHMARK.WEIGHTS_FROM}
    for split in splits:
        loader = build_loader(cfg.DATA, split, seed=cfg.SEED_VALUE, device=device)
        progress = Progress(f"extract {split}", len(loader), len(loader.dataset))
        batches = (
            (images, batch["label"], batch["index"])
            for images, batch in progress.over(common.one_view_batches(loader, device))
        )
        features, labels, indices = common.extract_batches(
            trunk, batches, names, cfg.BENCHMARK.POOL_SIZE, dtype, device, cfg.BENCHMARK.FEATURE_VIEWS
        )
        mine = {"features": features, "label": labels, "index": indices, "split": split.lower()}
        torch.save(_to_cpu(mine), os.path.join(out_dir, f"{split.lower()}_rank{comm.get_rank()}.pt"))
        merged = merge(mine)  # collective
        if comm.is_main_process():
            dataset = getattr(loader.dataset, "dataset", loader.dataset)  # an IndexSubset's parent
            merged["path"] = [dataset.describe(i) for i in merged["index"].tolist()]
            written = write_split(out_dir, {**_to_cpu(merged), **source})
            shapes = {name: tuple(t.shape) for name, t in merged["features"].items()}
            logger.info(f"wrote {', '.join(written)} in {out_dir}: {shapes}")


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


def write_split(out_dir: str, record: dict) -> List[str]:
    """Write one merged split (:func:`merge` on CPU, plus "path", "weights", "network") in every
    format of the module docstring; returns the file names written."""
    stem = record["split"]
    torch.save(record, os.path.join(out_dir, f"{stem}.pt"))
    written = [f"{stem}.pt"]
    for name, rows in record["features"].items():
        np.save(os.path.join(out_dir, f"{stem}_{name}.npy"), rows.numpy())
        written.append(f"{stem}_{name}.npy")
    np.save(os.path.join(out_dir, f"{stem}_labels.npy"), record["label"].numpy())
    np.save(os.path.join(out_dir, f"{stem}_indices.npy"), record["index"].numpy())
    with open(os.path.join(out_dir, f"{stem}_paths.txt"), "w") as f:
        f.writelines(f"{path}\n" for path in record["path"])
    written += [f"{stem}_labels.npy", f"{stem}_indices.npy", f"{stem}_paths.txt"]
    return written + write_parquet(out_dir, record)


def write_parquet(out_dir: str, record: dict) -> List[str]:
    """``<split>_<feature>.parquet`` per feature (columns path, label, index, embedding), or one
    note and nothing without pyarrow."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        logger.info(
            'no parquet files: they need pyarrow (pip install "vistrain[parquet]"); the .npy files hold the same'
        )
        return []
    written = []
    for name, rows in record["features"].items():
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(rows.numpy().reshape(-1)), rows.shape[1])
        table = pa.table(
            {
                "path": pa.array(record["path"], pa.string()),
                "label": pa.array(record["label"].numpy()),
                "index": pa.array(record["index"].numpy()),
                "embedding": embedding,
            }
        )
        pq.write_table(table, os.path.join(out_dir, f"{record['split']}_{name}.parquet"))
        written.append(f"{record['split']}_{name}.parquet")
    return written


class Progress:
    """A log line with a bar, the images per second and the time left, at most every
    ``LOG_EVERY_SECONDS`` and after the last batch (rank 0 logs; the others count silently).
    ``batches``: this rank's batches; ``images``: the split's images (all ranks)."""

    def __init__(self, what: str, batches: int, images: int):
        self.what, self.batches, self.images = what, max(batches, 1), images
        self.done = 0
        self.start = self.last = time.perf_counter()

    def over(self, iterable):
        """Yield ``iterable``'s items, counting one batch after each is used."""
        for item in iterable:
            yield item
            self.step()

    def step(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.done < self.batches and now - self.last < LOG_EVERY_SECONDS:
            return
        self.last = now
        logger.info(self.line(now - self.start))

    def line(self, elapsed: float) -> str:
        """``extract TRAIN [#####...............]  25%  360/1437 images  120 img/s  eta 0:00:09``."""
        share = min(self.done / self.batches, 1.0)
        seen = round(share * self.images)
        filled = round(share * BAR)
        rate = seen / max(elapsed, 1e-9)
        eta = datetime.timedelta(seconds=int(elapsed * (1 - share) / max(share, 1e-9)))
        return (
            f"{self.what} [{'#' * filled}{'.' * (BAR - filled)}] {100 * share:3.0f}%  "
            f"{seen}/{self.images} images  {rate:.0f} img/s  eta {eta}"
        )


def _to_cpu(record: dict) -> Dict:
    out = dict(record)
    out["features"] = {name: t.cpu() for name, t in record["features"].items()}
    out["label"], out["index"] = record["label"].cpu(), record["index"].cpu()
    return out
