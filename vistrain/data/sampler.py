"""Distributed sampling: which sample indices each rank sees in each epoch, as pure rank arithmetic.

The epoch order is a permutation of ``range(num_samples)`` that depends only on ``(seed, epoch)``
(identity order when not shuffling). Rank ``r`` of ``W`` takes every W-th position of that order,
starting at ``r``, so iteration ``t`` of all ranks together covers the contiguous block
``order[t*B*W : (t+1)*B*W]`` of the global order (``B`` = per-rank batch size).

Uneven sizes (every rank must run the same number of iterations, or collectives hang):

* ``drop_last=True``: the order is cut to ``floor(N / (B*W)) * B*W`` positions: full batches only,
  every sample at most once per epoch, the tail of the permutation (a different one each epoch
  when shuffling) is not seen this epoch.
* ``drop_last=False``: the order is padded to ``ceil(N / W) * W`` positions by repeating it from
  its start (cyclically when ``N < W``). Every sample is seen; a few appear twice. Evaluation code
  that must count each sample once can deduplicate by the batch's ``"index"``. The last batch of
  each rank may be smaller than ``B``; all ranks have the same number of batches.

Resuming inside an epoch: ``set_epoch(epoch, start_iteration=k)`` makes the next pass skip the
first ``k * B`` indices of this rank, so the remaining batches are exactly the ones an
uninterrupted run would have produced.
"""

from typing import Iterator, List, Optional, Tuple

import torch
from torch.utils.data import Sampler

from vistrain.config.errors import ConfigError
from vistrain.config.words import plural
from vistrain.distributed import comm

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """Hash integers into a well-mixed 63-bit seed (splitmix64 finaliser applied per value).

    Used for the epoch order ``mix_seed(seed, epoch)`` and for per-sample augmentation
    ``mix_seed(seed, epoch, index)``; neighbouring inputs give unrelated seeds, unlike ``seed + epoch``.
    """
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (int(value) & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state >> 1  # torch.manual_seed and Generator accept up to 2**63 - 1 comfortably


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The global order of one epoch: LongTensor (num_samples,), a permutation of range(num_samples)."""
    if not shuffle:
        return torch.arange(num_samples, dtype=torch.long)
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def samples_per_rank(num_samples: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """How many indices each rank gets per epoch (the same on every rank)."""
    if drop_last:
        return (num_samples // (batch_size * world_size)) * batch_size
    return -(-num_samples // world_size)  # ceil


def rank_indices(
    num_samples: int,
    world_size: int,
    rank: int,
    batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
) -> List[int]:
    """Indices of rank ``rank`` for one epoch, in iteration order (see the module docstring)."""
    per_rank = samples_per_rank(num_samples, world_size, batch_size, drop_last)
    order = epoch_order(num_samples, seed, epoch, shuffle)
    positions = torch.arange(rank, per_rank * world_size, world_size)
    return order[positions % num_samples].tolist()  # modulo: the padding repeats the order


def _check_args(num_samples, world_size, rank, batch_size, drop_last) -> None:
    if num_samples <= 0:
        raise ValueError(f"the data set is empty (num_samples={num_samples})")
    if batch_size <= 0:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if drop_last and num_samples < batch_size * world_size:
        raise ConfigError(
            f"DROP_LAST with {plural(num_samples, 'sample')} and {plural(world_size, 'rank')} x batch {batch_size} "
            "leaves no full batch; lower BATCHSIZE_PER_REPLICA or set DROP_LAST False"
        )


class DistributedSampler(Sampler):
    """Per-rank sampler yielding ``(index, epoch)`` keys; works with or without torch.distributed.

    The epoch travels with every index so that the dataset can seed augmentations from
    ``(seed, epoch, index)`` even inside persistent DataLoader workers, which never see
    ``set_epoch`` calls made in the main process.

    Args:
        num_samples: size of the data set.
        batch_size: per-rank batch size (needed to drop incomplete batches and to resume).
        shuffle: a new permutation every epoch, a function of ``(seed, epoch)`` only.
        drop_last: see the module docstring.
        seed: base seed of the order.
        rank, world_size: default to ``vistrain.distributed.comm`` (0 and 1 in one process).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        self.rank = comm.get_rank() if rank is None else rank
        self.world_size = comm.get_world_size() if world_size is None else world_size
        _check_args(num_samples, self.world_size, self.rank, batch_size, drop_last)
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.start_iteration = 0

    def set_epoch(self, epoch: int, start_iteration: int = 0) -> None:
        """Select the epoch of the next pass; skip its first ``start_iteration`` batches (resume).

        The skip stays in force until the next ``set_epoch`` call; call this before every epoch.
        """
        if start_iteration < 0 or start_iteration > self.num_batches():
            raise ValueError(
                f"start_iteration {start_iteration} is outside [0, {self.num_batches()}] "
                "(iterations per epoch on this rank)"
            )
        self.epoch = epoch
        self.start_iteration = start_iteration

    def indices(self) -> List[int]:
        """This rank's remaining indices of the current epoch (after the resume skip)."""
        mine = rank_indices(
            self.num_samples,
            self.world_size,
            self.rank,
            self.batch_size,
            self.seed,
            self.epoch,
            self.shuffle,
            self.drop_last,
        )
        return mine[self.start_iteration * self.batch_size :]

    def num_batches(self) -> int:
        """Iterations of a full epoch on this rank (the same on every rank)."""
        per_rank = len(self)
        if self.drop_last:
            return per_rank // self.batch_size
        return -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        epoch = self.epoch
        return iter([(index, epoch) for index in self.indices()])

    def __len__(self) -> int:
        """Indices of a *full* epoch on this rank, also right after a mid-epoch ``set_epoch``."""
        return samples_per_rank(self.num_samples, self.world_size, self.batch_size, self.drop_last)
