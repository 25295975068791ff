"""Where a run stands in its data: the epoch layout and the resume position on any world size.

The position in an epoch is mapped through the number of samples already seen: iteration ``t``
of every run covers global positions ``[t*B, (t+1)*B)`` of the epoch's order (B = global batch,
see vistrain.data.sampler), so with an unchanged global batch the resume is exact; with another
global batch the run resumes at the last batch boundary not after the saved position (at most
B' - 1 samples of that epoch are seen twice; logged).
"""

import dataclasses
import logging

from vistrain.checkpoint.identity import OtherRunError

logger = logging.getLogger("vistrain")


@dataclasses.dataclass(frozen=True)
class EpochLayout:
    """How a run walks through its data: what the position in an epoch means."""

    iters_per_epoch: int
    global_batch: int  # images per iteration over all ranks
    num_samples: int  # size of the training set
    update_freq: int = 1  # optimizer steps happen every update_freq iterations

    def as_meta(self) -> dict:
        return {
            "iters_per_epoch": self.iters_per_epoch,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
        }

    def samples_seen(self, epoch: int, iteration_in_epoch: int) -> int:
        """Training progress, comparable across world sizes and batch sizes:
        ``epoch * num_samples + iteration_in_epoch * global_batch`` (checkpoints are ranked by it)."""
        return epoch * self.num_samples + iteration_in_epoch * self.global_batch


def resume_iteration(meta: dict, now: EpochLayout, path: str) -> int:
    """The iteration of this run equivalent to where checkpoint ``meta`` stopped (module docstring)."""
    if meta.get("num_samples") not in (None, now.num_samples):
        raise OtherRunError(  # the launcher and resume() say it first, naming a free folder
            f"{path} was trained on {meta['num_samples']} samples, this run has "
            f"{now.num_samples} (the data changed); start a new CHECKPOINT.DIR"
        )
    epoch, done = meta["epoch"], meta.get("iteration_in_epoch", 0)
    before = (meta.get("iters_per_epoch"), meta.get("global_batch"))
    if before == (now.iters_per_epoch, now.global_batch):
        return meta["iteration"]
    samples = done * meta["global_batch"]
    position = min(samples // now.global_batch // now.update_freq * now.update_freq, now.iters_per_epoch)
    if samples != position * now.global_batch:
        logger.warning(
            f"{path}: {samples} samples of epoch {epoch} were done with a global batch of "
            f"{meta['global_batch']}; with {now.global_batch} this run restarts that epoch at "
            f"iteration {position} ({samples - position * now.global_batch} samples seen again)"
        )
    return epoch * now.iters_per_epoch + position
