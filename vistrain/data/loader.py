"""``build_loader``: dataset + transforms + distributed sampler + collator -> DataLoader of one rank."""

import logging
import os
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader

from vistrain.data.datasets import IndexSubset, SSLDataset, build_dataset, build_sources
from vistrain.data.device_views import DeviceViewsLoader
from vistrain.data.pixels import channel_stats
from vistrain.data.sampler import DistributedSampler
from vistrain.data.shards import ShardSampler, shard_sizes
from vistrain.data.transforms import unit_pixels
from vistrain.data.workers import WorkerLoader, leave_stop_signals_to_the_rank
from vistrain.distributed import comm

logger = logging.getLogger(__name__)
SPLITS = ("TRAIN", "TEST")


def build_loader(
    data_cfg,
    split: str,
    seed: int,
    device: torch.device,
    rank=None,
    world_size=None,
    indices: Optional[Sequence[int]] = None,
) -> DataLoader:
    """The DataLoader of ``data_cfg[split]`` for this rank.

    Args:
        data_cfg: the ``DATA`` config section.
        split: ``"TRAIN"`` or ``"TEST"``.
        seed: base of the data order and of the augmentations (``SEED_VALUE``); every rank passes
            the same value: ranks differ by their part of the order, not by their seed.
        device: where batches go; memory is pinned only for CUDA (and ``DATA.PIN_MEMORY``).
        rank, world_size: default to ``vistrain.distributed.comm``.
        indices: use only these samples of the split (e.g. a held-out part), see ``IndexSubset``.

    Returns:
        A DataLoader yielding ``collate_multicrop`` dicts (``dataset.collate``; with
        ``VIEWS_ON_DEVICE`` or ``DECODE_ON_DEVICE`` the crops are made, and are, on ``device``). ``len(loader)`` is the number of
        iterations of a full epoch on this rank (equal on all ranks). Call
        ``loader.sampler.set_epoch(epoch, start_iteration)`` (or ``vistrain.data.set_epoch``)
        before iterating each epoch; after ``start_iteration=k`` the pass yields
        ``len(loader) - k`` batches, identical to the last ones of an uninterrupted epoch.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")
    split_cfg = data_cfg[split]
    mean_std = None
    if data_cfg.NORMALIZE_FROM_IMAGES > 0:  # the command line computes them once, before the ranks
        *mean_std, count = image_statistics(data_cfg)
        if comm.is_main_process():
            logger.info(statistics_line(*mean_std, count))
    dataset = build_dataset(
        split_cfg, data_cfg.CACHE_DIR, seed=seed, key=f"DATA.{split}", split_seed=data_cfg.SPLIT_SEED,
        channels=data_cfg.CHANNELS, mean_std=mean_std,
    )  # fmt: skip
    if indices is not None:
        dataset = IndexSubset(dataset, indices)
    batch_size = split_cfg.BATCHSIZE_PER_REPLICA
    order = dict(
        shuffle=split_cfg.SHUFFLE, drop_last=split_cfg.DROP_LAST, seed=seed, rank=rank, world_size=world_size
    )
    sizes = shard_sizes(dataset)  # tar shards only: their epoch rule (vistrain/data/shards.py)
    if sizes is None:
        sampler = DistributedSampler(len(dataset), batch_size, **order)
    else:
        sampler = ShardSampler(sizes, batch_size, split_cfg.SHUFFLE_WINDOW, **order)
    workers = data_cfg.NUM_DATALOADER_WORKERS  # >= -1: checked with the config (vistrain.config.checks)
    if workers < 0:
        workers = auto_workers(
            _cores(), _ranks_per_node(), torch.get_num_threads(), torch.device(device).type == "cuda"
        )
    settings = dict(
        batch_size=batch_size,
        sampler=sampler,
        drop_last=split_cfg.DROP_LAST,  # the sampler already holds whole batches only; kept for clarity
        num_workers=workers,
        pin_memory=bool(data_cfg.PIN_MEMORY) and torch.device(device).type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=leave_stop_signals_to_the_rank if workers > 0 else None,
    )
    if (
        split_cfg.VIEWS_ON_DEVICE or split_cfg.DECODE_ON_DEVICE
    ):  # workers (decode and) draw; views on ``device``
        return DeviceViewsLoader(dataset, device, **settings)
    return WorkerLoader(dataset, collate_fn=dataset.collate, **settings)  # the views of a batch made together


MAX_AUTO_WORKERS = 8


def auto_workers(cores: int, ranks_per_node: int, threads_per_rank: int, cuda: bool) -> int:
    """DataLoader workers per rank for ``DATA.NUM_DATALOADER_WORKERS: -1``.

    CPU ranks compute with ``threads_per_rank`` threads each; only the cores they leave free can
    load data alongside (a worker on a core that computes slows the step by what it saves), so each
    rank gets its share of the spare cores, 0 when there are none: the rank then loads its own
    batches, and ``data_share`` in metrics.jsonl says what that costs. CUDA ranks leave the CPU to
    the data: a core per rank stays with the rank, the rest are shared out. At most 8 per rank.
    """
    ranks = max(1, ranks_per_node)
    if cuda:
        spare = max(1, cores // ranks - 1)
    else:
        spare = max(0, cores - ranks * max(1, threads_per_rank)) // ranks
    return min(MAX_AUTO_WORKERS, spare)


def _cores() -> int:
    """Cores this process may run on (a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _ranks_per_node() -> int:
    """Ranks sharing this machine: torchrun's LOCAL_WORLD_SIZE, else every rank of the job (spawned here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or comm.get_world_size()


def set_epoch(loader: DataLoader, epoch: int, start_iteration: int = 0) -> None:
    """Prepare ``loader`` (from ``build_loader``) for ``epoch``, skipping its first ``start_iteration`` batches."""
    sampler = getattr(loader, "sampler", None)
    if not hasattr(sampler, "set_epoch"):
        raise TypeError(
            f"the loader's sampler {type(sampler).__name__} has no set_epoch; build it with build_loader"
        )
    sampler.set_epoch(epoch, start_iteration)


class _UnitPixels:
    """The transform of :func:`image_statistics`: an image's pixels as the views start from them,
    float (c, H, W) in [0, 1]."""

    def __init__(self, pixel_range: Sequence[float]):
        self.pixel_range = pixel_range

    def prepare(self, image, generator: torch.Generator) -> torch.Tensor:
        pixels = unit_pixels(image, self.pixel_range)
        return pixels.float().div_(255) if pixels.dtype == torch.uint8 else pixels


def image_statistics(data_cfg) -> Tuple[List[float], List[float], int]:
    """Per-channel (mean, std, images read) of ``DATA.NORMALIZE_FROM_IMAGES`` images of ``DATA.TRAIN`` (at most), evenly
    spaced over it (indices floor(k L / N)), fitted to ``DATA.CHANNELS`` and scaled to [0, 1] as
    for the views (DATA.TRAIN.PIXEL_RANGE), unreadable ones as SKIP_CORRUPT says."""
    split_cfg, channels = data_cfg.TRAIN, data_cfg.CHANNELS
    sources = build_sources(split_cfg, data_cfg.CACHE_DIR, data_cfg.SPLIT_SEED)
    transform = _UnitPixels([float(v) for v in split_cfg.PIXEL_RANGE])
    dataset = SSLDataset(
        sources, transform, 0, split_cfg.SKIP_CORRUPT, split_cfg.DATA_LIMIT, "DATA.TRAIN", channels
    )
    wanted = min(data_cfg.NORMALIZE_FROM_IMAGES, len(dataset))
    mean, std = channel_stats(
        [dataset[k * len(dataset) // wanted]["prepared"] for k in range(wanted)], channels
    )
    return mean, std, wanted


def statistics_line(mean: Sequence[float], std: Sequence[float], count: int) -> str:
    """What :func:`image_statistics` found, in one line."""
    return (
        f"normalising with the mean {_rounded(mean)} and std {_rounded(std)} of {count} "
        "images of DATA.TRAIN (DATA.NORMALIZE_FROM_IMAGES; set TRANSFORMS.MEAN and STD to these to fix them)"
    )


def _rounded(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"
