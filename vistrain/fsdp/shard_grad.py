"""The gradients of one flat shard's local parameters, kept as DDP keeps ``.grad``.

Each original parameter is a parameter of its module on every rank: this rank's part of it, a
view of the flat shard (``FlatParamHandle.local_params``). A finished reduction (this rank's
slice of the averaged flat gradient, one shard-sized tensor) is handed to them as views, or
added to the gradients they already hold. So ``p.grad`` is that parameter's gradient (this
rank's part), ``p.grad = None`` / ``mul_`` / ``clamp_`` act on it alone, and an optimizer keeps
per-parameter state, exactly as under DDP.

**Parameters without gradient.** A view that got no gradient in backward is seen by a hook on
the split of the gathered weights into views; the ranks agree (a MAX all-reduce of flags,
``reductions.py``: one per backward, or one per flat parameter with the step in backward), and
a parameter no rank gave a gradient keeps ``.grad`` as it was (None stays None), as DDP leaves
globally unused parameters: optimizers skip it (no weight decay, momentum or Adam step), in
both step modes, with or without ``find_unused_parameters``. Until the ranks agreed, a
parameter this rank gave no gradient is left as it is (``pending``).

**One addition.** Once every gradient is a view of one shard-sized tensor (what a reduction
handed over, kept by ``zero_grad(set_to_none=False)``), the next reduction is added to that
tensor at once instead of parameter by parameter.

**no_sync micro-batches.** Under ``no_sync()`` a handle keeps its full (unsharded) gradient on
the rank and reduces it with the next synced backward. DDP keeps those gradients in ``.grad``,
so ``zero_grad()`` drops them; here the local parameters get zero gradients (views of one
placeholder) the micro-batches are kept *with*: dropping every one of them
(``optimizer.zero_grad()``) drops the micro-batches; zeroing them in place
(``zero_grad(set_to_none=False)``, seen by the placeholder's version counter) drops the values
and keeps which parameters had a gradient (DDP's zeroed ``.grad`` is not None).

**Recovery.** The gradients the current accumulation group created are dropped when a step is
interrupted (training goes on as if the step had been skipped).
"""

import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from vistrain.torch_compat import version_counter, view_base


def own_shard_grad(reduced: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``reduced`` as a tensor with its own shard-sized storage on ``device`` in ``dtype``.

    A view into a larger buffer (gloo's all-reduced full gradient) would keep that whole buffer
    alive as long as the gradient lives: storage bytes, not element counts, are what a rank holds.
    """
    out = reduced.to(device, dtype)
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone()
    return out


def grad_base(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor whose view ``grad`` is (itself when it is no view)."""
    if grad is None:
        return None
    base = view_base(grad)
    return base if base is not None else grad


@dataclass
class UnshardedAccumulator:
    """The summed full gradients (padded_numel,) of the no_sync micro-batches since the last
    synced backward (None once zeroed in place), which origins got a gradient in them, and the
    gradient storage (and its version) they were kept with."""

    grad: Optional[torch.Tensor]
    used_origins: Optional[List[bool]]
    kept_with: "weakref.ref"
    kept_version: int

    def follow(self) -> bool:
        """Whether anything is still kept once the local gradients are as they are now."""
        base = self.kept_with()
        if base is None:  # every gradient viewing it was dropped
            return False
        if version_counter(base) != self.kept_version:  # zeroed in place
            self.grad, self.kept_version = None, version_counter(base)
        return True


class ShardGrad:
    """The gradients of one handle's ``local_params``. ``origin_slices``: (origin index,
    start in the shard, length) of each original parameter with elements on this rank;
    ``num_origins``: how many the flat parameter holds (on every rank)."""

    def __init__(
        self, local_params: List[nn.Parameter], origin_slices: Sequence[Tuple[int, ...]], num_origins: int
    ):
        self.local_params = local_params
        self.origin_slices = [(i, start, n) for i, start, _, n in origin_slices]
        self.num_origins = num_origins
        held = {i: (start, n) for i, start, n in self.origin_slices}
        # (start in the shard, length) of each origin's part on this rank ((0, 0): none)
        self.parts = [held.get(i, (0, 0)) for i in range(len(local_params))]
        self._used: Optional[List[bool]] = None  # views with a gradient in this backward, this rank
        self._accumulated: Optional[UnshardedAccumulator] = None
        self._created: Optional[weakref.ref] = None  # gradient storage this accumulation group made
        # the shard-sized tensor every gradient viewed when add_reduced last made them all, and
        # (parameter, start in it, length) of each trained parameter (the one-addition path)
        self._held: Optional[weakref.ref] = None
        self._grad_starts: List[Tuple[nn.Parameter, int, int]] = []
        # (reduced, placeholder, origins) waiting for the end-of-backward agreement
        self._pending: Optional[Tuple[torch.Tensor, Optional[torch.Tensor], Tuple[int, ...]]] = None

    # -- which origins got a gradient --------------------------------------------------------
    def note_used(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Hook on the split into views: ``grads[i]`` is None when origin i's view got none."""
        used = self._used or [False] * self.num_origins
        self._used = [u or g is not None for u, g in zip(used, grads)]

    def used_origins(self) -> List[bool]:
        """Per origin: a gradient on this rank in this backward or the kept micro-batches'."""
        used = self._used or [False] * self.num_origins
        accumulated = self.accumulated()
        if accumulated is not None and accumulated.used_origins is not None:
            used = [a or b for a, b in zip(used, accumulated.used_origins)]
        return used

    def _held_grads(self):
        return [param.grad for param in self.local_params]

    # -- no_sync micro-batches ---------------------------------------------------------------
    def accumulated(self) -> Optional[UnshardedAccumulator]:
        """The kept micro-batches, unless their gradients were dropped since."""
        if self._accumulated is not None and not self._accumulated.follow():
            self._accumulated = None
        return self._accumulated

    def keep_unsharded(self, grad: torch.Tensor) -> None:
        """no_sync: add the full gradient (param dtype) to the kept ones."""
        accumulated = self.accumulated()
        used = self.used_origins()
        self._used = None
        if accumulated is None:
            base = self._kept_with()
            accumulated = UnshardedAccumulator(grad.clone(), used, weakref.ref(base), 0)
        elif accumulated.grad is None:
            accumulated.grad, accumulated.used_origins = grad.clone(), used
        else:
            accumulated.grad.add_(grad)
            accumulated.used_origins = used
        accumulated.kept_version = version_counter(accumulated.kept_with())
        self._accumulated = accumulated

    def _kept_with(self) -> torch.Tensor:
        """The storage of the local gradients, made (zeros, one view per held parameter) when
        none has one: the micro-batches live as long as it does."""
        base = next((grad_base(g) for g in self._held_grads() if g is not None), None)
        if base is not None:
            return base
        shard = self.local_params[0]
        numel = max((start + n for _, start, n in self.origin_slices), default=0)
        base = torch.zeros(numel, dtype=shard.dtype, device=shard.device)
        held = {i: (start, n) for i, start, n in self.origin_slices}
        for i, param in enumerate(self.local_params):  # empty views too: they keep ``base`` alive
            start, n = held.get(i, (0, 0))
            if param.requires_grad:
                param.grad = base[start : start + n].view(param.shape)
        self._created = weakref.ref(base)
        return base

    def with_accumulated(self, grad: torch.Tensor) -> torch.Tensor:
        """A synced backward's full gradient plus the kept micro-batches'; they are handed over."""
        accumulated = self.accumulated()
        if accumulated is not None and accumulated.grad is not None:
            grad = accumulated.grad.add_(grad)
        self._accumulated, self._used = None, None
        return grad

    # -- the reduced gradient ----------------------------------------------------------------
    def add_reduced(
        self, reduced: torch.Tensor, without_grad: Tuple[int, ...], pending: Tuple[int, ...] = ()
    ) -> None:
        """Hand a finished reduction (shard_numel,) to the local parameters: a view of it where
        a parameter has no gradient (or only the micro-batches' placeholder), added where it
        has one; ``without_grad``: origins no rank gave a gradient (their ``.grad`` stays);
        ``pending``: origins this rank gave none, left as they are until the ranks agree at the
        end of backward (:meth:`add_pending`)."""
        placeholder = self._created() if self._created is not None else None
        if placeholder is None and not (without_grad or pending) and self._add_to_held(reduced):
            return
        shard = self.local_params[0]
        reduced = own_shard_grad(reduced, shard.device, shard.dtype)
        if pending:
            self._pending = (reduced, placeholder, pending)
        now = [i for i in range(len(self.local_params)) if i not in pending]
        if self._hand_over(reduced, placeholder, now, without_grad) and not pending:
            self._remember_held(reduced)

    def add_pending(self, used: Sequence[bool]) -> None:
        """The ranks agreed which origins any of them gave a gradient (``used``, per origin):
        the pending ones of the last :meth:`add_reduced` get theirs now, or keep ``.grad``."""
        if self._pending is None:
            return
        (reduced, placeholder, pending), self._pending = self._pending, None
        self._hand_over(reduced, placeholder, pending, tuple(i for i in pending if not used[i]))

    def _hand_over(self, reduced, placeholder, origins: Sequence[int], without_grad) -> bool:
        """:meth:`add_reduced` for ``origins``; whether every trained one got a view of ``reduced``."""
        # a parameter this rank holds no element of gets an empty gradient: ``.grad is None``
        # then means the same on every rank (optimizers that communicate, LARS, stay in step)
        parts, views_only = self.parts, True
        for i in origins:
            param, (start, n) = self.local_params[i], parts[i]
            if not param.requires_grad:
                continue
            grad = param.grad
            is_placeholder = placeholder is not None and grad_base(grad) is placeholder
            if i in without_grad:
                if is_placeholder:  # zeros standing in during no_sync: DDP would have None
                    param.grad = None
                views_only = False
            elif grad is None or is_placeholder:
                param.grad = reduced[start : start + n].view(param.shape)
                self._created = weakref.ref(reduced)
            else:
                grad.add_(reduced[start : start + n].view_as(grad))
                views_only = False
        return views_only

    def _add_to_held(self, reduced: torch.Tensor) -> bool:
        """The common case as one addition: every gradient is still the view of one shard-sized
        tensor that an earlier :meth:`add_reduced` made (kept, zeroed in place by
        ``zero_grad(set_to_none=False)``); ``reduced`` is added to that tensor, padding and
        frozen parameters' places included (no parameter views them). False, touching nothing,
        when any gradient is missing, replaced or moved."""
        base = self._held() if self._held is not None else None
        if base is None or base.numel() != reduced.numel():
            return False
        ptr, size = base.data_ptr(), base.element_size()
        for param, start, n in self._grad_starts:
            grad = param.grad
            if grad is None:
                return False
            if n and (view_base(grad) is not base or grad.data_ptr() != ptr + start * size):
                return False  # (an empty gradient has nothing to add and no address)
        with torch.no_grad():
            base.add_(reduced.to(base.device, base.dtype))
        return True

    def _remember_held(self, reduced: torch.Tensor) -> None:
        """After :meth:`add_reduced` gave every trained parameter a view of ``reduced``."""
        self._held = weakref.ref(reduced)
        self._grad_starts = [
            (param, start, n)
            for param, (start, n) in zip(self.local_params, self.parts)
            if param.requires_grad
        ]

    # -- step boundaries ---------------------------------------------------------------------
    def end_step(self) -> None:
        """A synced backward finished: its gradients are the step's."""
        self._created = None

    def drop_step(self) -> None:
        """After an interrupted step: drop the kept micro-batches and the gradients this
        accumulation group created (what it added to older gradients stays, as DDP's)."""
        self._accumulated, self._used, self._pending = None, None, None
        created = self._created() if self._created is not None else None
        if created is not None:
            for param in self.local_params:
                if grad_base(param.grad) is created:
                    param.grad = None
        self._created = None

    def tensors(self):
        """The kept micro-batches' gradient and a reduction waiting for the ranks' agreement,
        if any (memory accounting)."""
        if self._accumulated is not None and self._accumulated.grad is not None:
            yield self._accumulated.grad
        if self._pending is not None:
            yield self._pending[0]
