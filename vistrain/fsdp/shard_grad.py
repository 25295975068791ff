"""What a flat shard's gradient carries besides its values, kept as DDP keeps it in ``.grad``.

**no_sync micro-batches.** Under ``no_sync()`` a handle keeps its full (unsharded) gradient on
the rank and reduces it with the next synced backward. DDP keeps those gradients in ``.grad``,
so ``zero_grad()`` drops them; here they are kept *with* ``shard.grad`` (created as zeros when
there is none): clearing or replacing ``shard.grad`` (``optimizer.zero_grad()``,
``model.zero_grad()``, ``p.grad = None``) drops them; zeroing it in place
(``zero_grad(set_to_none=False)``, seen by its version counter) drops the values and keeps which
parameters had a gradient (DDP's zeroed ``.grad`` is not None).

**Parameters without gradient** (``find_unused_parameters``). A flat shard concatenates several
original parameters; one that got no gradient on any rank gets zeros there instead of DDP's
``.grad = None``. A hook on the split of the gathered weights into views sees, per backward,
which views got a gradient; the ranks agree (a MAX all-reduce, ``reductions.py``), and an origin
stays *without gradient* only while it had none in every backward since ``shard.grad`` was last
empty. The optimizer steps then leave its slices and their optimizer state alone
(``ownership.hold_slices_without_grad``).

**Recovery.** ``created_this_step``: the current accumulation group created ``shard.grad``, so
an interrupted step drops it (training goes on as if the step had been skipped).
"""

import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from vistrain.fsdp.ownership import hold_slices_without_grad
from vistrain.torch_compat import version_counter


def own_shard_grad(reduced: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``reduced`` as a tensor with its own shard-sized storage on ``device`` in ``dtype``.

    A view into a larger buffer (gloo's all-reduced full gradient) would keep that whole buffer
    alive as long as the gradient lives: storage bytes, not element counts, are what a rank holds.
    """
    out = reduced.to(device, dtype)
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone()
    return out


@dataclass
class UnshardedAccumulator:
    """The summed full gradients (padded_numel,) of the no_sync micro-batches since the last
    synced backward (None once zeroed in place), which origins got a gradient in them, and the
    ``shard.grad`` (and its version) they were kept with."""

    grad: Optional[torch.Tensor]
    used_origins: Optional[List[bool]]
    grad_ref: "weakref.ref"
    grad_version: int

    def follow(self, shard_grad: Optional[torch.Tensor]) -> bool:
        """Whether anything is still kept once ``shard.grad`` is as it is now."""
        if shard_grad is None or self.grad_ref() is not shard_grad:
            return False
        if version_counter(shard_grad) != self.grad_version:  # zeroed in place
            self.grad, self.grad_version = None, version_counter(shard_grad)
        return True


class ShardGrad:
    """The bookkeeping of one flat ``shard``'s gradient. ``origin_slices``: (origin index,
    start in the shard, length) of each original parameter with elements on this rank;
    ``num_origins``: how many the flat parameter holds (on every rank)."""

    def __init__(self, shard: nn.Parameter, origin_slices: Sequence[Tuple[int, int, int]], num_origins: int):
        self.shard = shard
        self.origin_slices = list(origin_slices)
        self.num_origins = num_origins
        self.track_origin_use = False  # find_unused_parameters (set by the model)
        self._used: Optional[List[bool]] = None  # views with a gradient in this backward, this rank
        self._accumulated: Optional[UnshardedAccumulator] = None
        self.origins_without_grad: Tuple[int, ...] = ()
        self.created_this_step = False
        self._placeholder: Optional[weakref.ref] = None  # zeros created to keep micro-batches with

    # -- which origins got a gradient --------------------------------------------------------
    def note_used(self, grad_outputs) -> None:
        """Hook on the split into views: ``grad_outputs[i]`` is None when view i got none."""
        used = self._used or [False] * self.num_origins
        self._used = [u or g is not None for u, g in zip(used, grad_outputs)]

    def used_origins(self) -> List[bool]:
        """Per origin: a gradient on this rank in this backward or the kept micro-batches'
        (all True when not tracked: without find_unused_parameters every origin counts as used)."""
        if not self.track_origin_use:
            return [True] * self.num_origins
        used = self._used or [False] * self.num_origins
        accumulated = self.accumulated()
        if accumulated is not None and accumulated.used_origins is not None:
            used = [a or b for a, b in zip(used, accumulated.used_origins)]
        return used

    def slices_without_grad(self) -> List[Tuple[int, int]]:
        """(start, length) inside the shard of each origin in ``origins_without_grad``."""
        return [(start, n) for i, start, n in self.origin_slices if i in self.origins_without_grad]

    # -- no_sync micro-batches ---------------------------------------------------------------
    def accumulated(self) -> Optional[UnshardedAccumulator]:
        """The kept micro-batches, unless ``shard.grad`` was cleared or replaced since."""
        if self._accumulated is not None and not self._accumulated.follow(self.shard.grad):
            self._accumulated = None
        return self._accumulated

    def keep_unsharded(self, grad: torch.Tensor) -> None:
        """no_sync: add the full gradient (param dtype) to the kept ones."""
        accumulated = self.accumulated()
        used = self.used_origins() if self.track_origin_use else None
        self._used = None
        if accumulated is None:
            if self.shard.grad is None:
                self.shard.grad = torch.zeros_like(self.shard)
                self.created_this_step = True
                self._placeholder = weakref.ref(self.shard.grad)
            accumulated = UnshardedAccumulator(grad.clone(), used, weakref.ref(self.shard.grad), 0)
        elif accumulated.grad is None:
            accumulated.grad, accumulated.used_origins = grad.clone(), used
        else:
            accumulated.grad.add_(grad)
            accumulated.used_origins = used
        accumulated.grad_version = version_counter(self.shard.grad)
        self._accumulated = accumulated

    def with_accumulated(self, grad: torch.Tensor) -> torch.Tensor:
        """A synced backward's full gradient plus the kept micro-batches'; they are handed over."""
        accumulated = self.accumulated()
        if accumulated is not None and accumulated.grad is not None:
            grad = accumulated.grad.add_(grad)
        self._accumulated, self._used = None, None
        return grad

    # -- the reduced gradient ----------------------------------------------------------------
    def add_reduced(self, reduced: torch.Tensor, without_grad: Tuple[int, ...]) -> None:
        """Add a finished reduction (shard_numel,) to ``shard.grad`` (created as its own
        shard-sized tensor); ``without_grad``: the origins no rank gave a gradient."""
        placeholder = self._placeholder is not None and self._placeholder() is self.shard.grad
        self._placeholder = None
        if self.shard.grad is None or placeholder:  # no reduced gradient in it yet
            self._set_without_grad(tuple(without_grad))
        else:
            self._set_without_grad(tuple(i for i in self.origins_without_grad if i in without_grad))
        if self.shard.grad is None:
            self.shard.grad = own_shard_grad(reduced, self.shard.device, self.shard.dtype)
            self.created_this_step = True
        else:
            self.shard.grad.add_(reduced.to(self.shard.device, self.shard.dtype))

    def _set_without_grad(self, origins: Tuple[int, ...]) -> None:
        if origins or self.origins_without_grad:
            hold_slices_without_grad(self, bool(origins))
        self.origins_without_grad = origins

    # -- step boundaries ---------------------------------------------------------------------
    def end_step(self) -> None:
        """A synced backward finished: its gradients are the step's."""
        self.created_this_step = False

    def drop_step(self) -> None:
        """After an interrupted step: drop the kept micro-batches and the ``shard.grad`` this
        accumulation group created (what it added to an older ``shard.grad`` stays, as DDP's)."""
        self._accumulated, self._used, self._placeholder = None, None, None
        if self.created_this_step:
            self.shard.grad = None
            self._set_without_grad(())
        self.created_this_step = False

    def tensors(self):
        """The kept micro-batches' gradient, if any (memory accounting)."""
        if self._accumulated is not None and self._accumulated.grad is not None:
            yield self._accumulated.grad
