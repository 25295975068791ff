"""Training checkpoints: ``CHECKPOINT.DIR/checkpoint_<iteration>/``, world-size independent.

Layout of one checkpoint (see :mod:`vistrain.checkpoint` for the code)::

    rank<r>.pt      written by rank r, in parallel with the others: for every ORIGINAL parameter
                    slice rank r owns, ``params[fqn] = {"start", "values"}`` (1-D), the same for
                    each optimizer state tensor (``optimizer["tensors"][key][fqn]``, e.g.
                    momentum_buffer / exp_avg / exp_avg_sq) and per-shard scalars such as
                    ``step`` (``optimizer["scalars"][fqn]``); rank r's RNG states; rank r's extra
                    state (``extra["loss"]``: the loss's state dict, e.g. the SwAV queue;
                    ``extra["grad_scaler"]``). Rank 0 also writes the buffers (BatchNorm
                    statistics). A DDP (replicated) model is written whole by rank 0.
    metadata.json   written LAST by rank 0: every original parameter (fqn, shape, dtype,
                    requires_grad, and ``slices`` = [rank, start, length] of the files holding
                    it), buffers, the optimizer class / state kinds / param groups, iteration,
                    epoch, iteration_in_epoch, iters_per_epoch, global batch, data set size,
                    world size, config, vistrain and torch versions.

A save writes into ``checkpoint_<it>.tmp/`` (files fsync'd) and rank 0 renames the folder after
every rank finished, so a crash or a full disk never leaves a half checkpoint under a final name.

Resume on any world size M (saved by N ranks): each rank reads only the rank files overlapping
its shards and rebuilds its shards and optimizer state exactly. The position in the epoch is
mapped through the number of samples already seen: iteration ``t`` of every run covers global
positions ``[t*B, (t+1)*B)`` of the epoch's order (B = global batch, see vistrain.data.sampler),
so with an unchanged global batch the resume is exact; with another global batch the run resumes
at the last batch boundary not after the saved position (at most B' - 1 samples of that epoch are
seen twice; logged). Per-rank state (RNG, the SwAV queue) is restored only when the world size is
unchanged; otherwise the queue refills and the grad scaler comes from rank 0.
"""

import dataclasses
import logging

from vistrain.checkpoint import find_latest_checkpoint, load_sharded_checkpoint, read_metadata  # noqa: F401
from vistrain.checkpoint import save_sharded_checkpoint

logger = logging.getLogger("vistrain")


@dataclasses.dataclass(frozen=True)
class EpochLayout:
    """How a run walks through its data: what the position in an epoch means."""

    iters_per_epoch: int
    global_batch: int  # images per iteration over all ranks
    num_samples: int  # size of the training set
    update_freq: int = 1  # optimizer steps happen every update_freq iterations

    def as_meta(self) -> dict:
        return {"iters_per_epoch": self.iters_per_epoch, "global_batch": self.global_batch,
                "num_samples": self.num_samples}


def save_checkpoint(ckpt_dir: str, iteration: int, epoch: int, model, optimizer, extra: dict,
                    meta: dict, keep_last: int) -> str:
    """Write ``checkpoint_<iteration>`` (collective: every rank calls it). Returns its path.

    ``extra`` is this rank's state (loss state dict, grad scaler); ``meta`` is added to
    metadata.json (config, position). Afterwards only the ``keep_last`` newest complete
    checkpoints remain.
    """
    return save_sharded_checkpoint(ckpt_dir, iteration, model, optimizer, extra,
                                   {"epoch": epoch, **meta}, keep_last)


def read_meta(path: str) -> dict:
    """metadata.json of checkpoint ``path``."""
    return read_metadata(path)


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Load weights and optimizer state (any world size). Returns the extra state saved by this
    rank (rank 0's when the world size changed) plus ``meta``, ``rng`` (None when the world size
    changed) and ``same_world_size``."""
    loaded = load_sharded_checkpoint(path, model, optimizer)
    return {**loaded["extra"], "meta": loaded["metadata"], "rng": loaded["rng"],
            "same_world_size": loaded["same_world_size"]}


def resume_iteration(meta: dict, now: EpochLayout, path: str) -> int:
    """The iteration of this run equivalent to where checkpoint ``meta`` stopped (module docstring)."""
    if meta.get("num_samples") not in (None, now.num_samples):
        raise ValueError(f"{path} was trained on {meta['num_samples']} samples, this run has "
                         f"{now.num_samples} (the data changed); start a new CHECKPOINT.DIR")
    epoch, done = meta["epoch"], meta.get("iteration_in_epoch", 0)
    before = (meta.get("iters_per_epoch"), meta.get("global_batch"))
    if before == (now.iters_per_epoch, now.global_batch):
        return meta["iteration"]
    samples = done * meta["global_batch"]
    position = min(samples // now.global_batch // now.update_freq * now.update_freq, now.iters_per_epoch)
    if samples != position * now.global_batch:
        logger.warning(f"{path}: {samples} samples of epoch {epoch} were done with a global batch of "
                       f"{meta['global_batch']}; with {now.global_batch} this run restarts that epoch at "
                       f"iteration {position} ({samples - position * now.global_batch} samples seen again)")
    return epoch * now.iters_per_epoch + position
