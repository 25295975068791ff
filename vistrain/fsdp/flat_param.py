"""Flat, padded, sharded parameter storage for one group of original parameters.

A ``FlatParamHandle`` owns some original parameters of one sharded unit. Their values are laid
into one flat fp32 vector (``flat_layout``: in order, each moved by less than a row so that rank
boundaries fall between rows), padded to ``padded_numel = shard_numel * world_size`` and cut into
``world_size`` equal chunks; rank r keeps chunk r as ``shard``. Each original parameter stays a
parameter of its module: ``local_params[i]``, this rank's rows of it, a view of ``shard`` (what
``parameters()`` and optimizers see). Before compute, the chunks are all-gathered into ``full``
(padded_numel elements, compute dtype) and the modules' attributes become views of it; afterwards
the storage of ``full`` is released but the tensor object is kept, so the autograd graph and its
saved views see the data again after the next gather.

With hybrid sharding (``groups.replica``, see ``collectives.py``) the ranks of the replica group
hold the same shard; a gradient is reduce-scattered inside the shard group and its shard then
all-reduced over the replica group, each rank's contribution divided by ``world_size * replicas``
first.
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from vistrain.fsdp.collectives import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    ShardGroups,
    gather_into,
    reduce_scatter_into,
    wait_within,
)
from vistrain.fsdp.deferred_init import materialize
from vistrain.fsdp.ownership import register_local_param
from vistrain.fsdp.precision import Precision
from vistrain.fsdp.shard_grad import ShardGrad, own_shard_grad
from vistrain.torch_compat import own_parameters, version_counter


@dataclass
class ParamOrigin:
    """Where one original parameter lives: in its module and inside the flat vector."""

    local_fqn: str  # name relative to the wrapped module of the unit that owns it
    module: nn.Module  # module whose attribute ``attr`` is the parameter
    attr: str
    shape: torch.Size
    flat_offset: int  # first element inside the unpadded flat vector
    fqn: str = ""  # clean name relative to the root model (set by the outermost wrapper)
    # Further (module, attr) places holding the same tied parameter; they get the same view.
    aliases: List[Tuple[nn.Module, str]] = field(default_factory=list)
    requires_grad: bool = True  # the original parameter's flag, kept by its local parameter

    def places(self) -> List[Tuple[nn.Module, str]]:
        return [(self.module, self.attr)] + self.aliases

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def shard_size(numel: int, world_size: int) -> int:
    """Elements per rank for a flat vector of ``numel`` elements: ceil(numel / world_size)."""
    return max(1, -(-numel // world_size))


def padded_size(numel: int, world_size: int) -> int:
    """Elements of the flat vector padded to ``world_size`` equal shards."""
    return shard_size(numel, world_size) * world_size


def shard_range(numel: int, world_size: int, rank: int) -> Tuple[int, int]:
    """[start, end) of rank's chunk in the padded flat vector (may run into the padding)."""
    size = shard_size(numel, world_size)
    return rank * size, (rank + 1) * size


def row_size(shape: Sequence[int]) -> int:
    """Elements of one row (one index of dim 0) of a parameter: 1 for 0-D and 1-D ones."""
    return max(1, math.prod(shape[1:])) if len(shape) >= 2 else 1


# Padding this small is never worth a 1-D local parameter (16 KiB of fp32 per rank at most).
ALIGNMENT_FREE_ELEMENTS = 4096


def _place_aligned(numels: List[int], rows: List[int], shard: int, strict: bool) -> Tuple[List[int], int]:
    """Offsets putting each rank boundary (multiples of ``shard``) that cuts a parameter between
    two of its rows, and the row a ``strict`` placement still needs ``shard`` to be a multiple
    of (1: none): a parameter spanning several boundaries is cut between rows at each only then.
    Not ``strict``: such a parameter is aligned at its first boundary only."""
    offsets, pos = [], 0
    for n, row in zip(numels, rows):
        boundary = (pos // shard + 1) * shard  # the first one after the parameter's start
        if row > 1 and boundary < pos + n:
            pos += (boundary - pos) % row  # less than one row of padding
            if strict and boundary + shard < pos + n and shard % row:
                return offsets, row
        offsets.append(pos)
        pos += n
    return offsets, 1


def flat_layout(shapes: Sequence[Sequence[int]], world_size: int) -> Tuple[List[int], int]:
    """(offset of each parameter in the flat vector, elements per shard).

    Parameters follow each other in order; a parameter that a rank boundary would cut inside a
    row is moved up by less than one row, so each rank holds whole rows of it and its local
    part is a ``(rows, *shape[1:])`` tensor (row-wise code outside forward, e.g. normalising
    prototypes, then works on it as on the whole). A parameter spanning several boundaries
    makes the shard a multiple of its row; where that would cost more than 1/16 of the
    elements (and more than ``ALIGNMENT_FREE_ELEMENTS``), it is cut between rows at its first boundary only (its other parts are 1-D).
    """
    numels = [math.prod(s) for s in shapes]
    rows = [row_size(s) for s in shapes]
    total = sum(numels)
    shard, multiple, strict = shard_size(total, world_size), 1, world_size > 1
    for _ in range(32):
        if world_size == 1:
            break
        offsets, needs = _place_aligned(numels, rows, shard, strict)
        if needs > 1:
            multiple = math.lcm(multiple, needs)
            strict = multiple * world_size <= max(total // 16, ALIGNMENT_FREE_ELEMENTS)
            multiple = multiple if strict else 1
            shard = -(-shard // multiple) * multiple if strict else shard_size(total, world_size)
            continue
        end = offsets[-1] + numels[-1] if numels else 0
        if end <= shard * world_size:
            return offsets, shard
        shard = -(-shard_size(end, world_size) // multiple) * multiple
    return [sum(numels[:i]) for i in range(len(numels))], shard_size(total, world_size)


def local_shape(shape: Sequence[int], start: int, length: int) -> Tuple[int, ...]:
    """Shape of elements [start, start + length) of a flattened parameter of ``shape``: whole
    rows keep the trailing dims, anything else is 1-D."""
    shape = tuple(shape)
    if length == math.prod(shape):
        return shape
    row = row_size(shape)
    if len(shape) >= 2 and start % row == 0 and length % row == 0:
        return (length // row,) + shape[1:]
    return (length,)


def shard_slices(origins: Sequence[ParamOrigin], shard_numel: int, rank: int):
    """For each origin overlapping this rank's chunk: (origin index, start in shard, start in param, length).

    Pure rank arithmetic over the layout (``flat_offset`` of each origin, ``shard_numel`` per
    rank); used by the local parameters, state dicts and checkpoints.
    """
    lo, hi = rank * shard_numel, (rank + 1) * shard_numel
    out = []
    for i, o in enumerate(origins):
        start, end = max(lo, o.flat_offset), min(hi, o.flat_offset + o.numel)
        if start < end:
            out.append((i, start - lo, start - o.flat_offset, end - start))
    return out


def split_plan(origins: Sequence[ParamOrigin], padded_numel: int) -> Tuple[List[int], List[int]]:
    """Sizes splitting the gathered flat vector into parameters and the padding around them,
    and the index of each origin's piece among them."""
    sizes, pieces, pos = [], [], 0
    for o in origins:
        if o.flat_offset > pos:
            sizes.append(o.flat_offset - pos)
        pieces.append(len(sizes))
        sizes.append(o.numel)
        pos = o.flat_offset + o.numel
    sizes.append(padded_numel - pos)
    return sizes, pieces


@dataclass
class InFlightGather:
    """An all-gather of one handle's shards into its ``full`` tensor, started and not yet waited."""

    work: dist.Work
    source: torch.Tensor  # the shard in compute dtype/device; must live until the wait
    shard_version: int  # the shard's version counter when the gather started


class FlatParamHandle:
    """Shard storage, gather and gradient reduction for a list of original parameters."""

    def __init__(
        self,
        params: List[nn.Parameter],
        origins: List[ParamOrigin],
        groups: ShardGroups,
        compute_device: torch.device,
        precision: Precision,
        shard_device: torch.device,
        sync_module_states: bool,
    ):
        self.origins = origins
        self.groups = groups
        offsets, self.shard_numel = flat_layout([o.shape for o in origins], groups.size)
        self._local_slices = None
        for origin, offset in zip(origins, offsets):
            origin.flat_offset = offset
        self.numel = sum(o.numel for o in origins)
        self.param_dtype = params[0].dtype
        self.compute_dtype = precision.compute_dtype or self.param_dtype
        self.reduce_dtype = precision.reduce_dtype or self.compute_dtype
        self.compute_device = compute_device
        self.timeout = DEFAULT_COLLECTIVE_TIMEOUT  # the model's collective_timeout once attached
        self.gather_group = None  # the model's own group over the shard group's ranks once attached
        # frozen parameters share the flat vector (the layout must not depend on what trains: a
        # teacher, all frozen, pairs with its student); their local parameters get no gradient
        requires_grad = any(p.requires_grad for p in params)

        shard = self._own_shard(params, compute_device, sync_module_states)
        if sync_module_states and groups.replicas > 1:  # replicas start from the first one's shard
            dist.broadcast(shard, src=dist.get_global_rank(groups.replica, 0), group=groups.replica)
        self.shard = nn.Parameter(shard.to(shard_device), requires_grad=requires_grad)

        self.full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=compute_device)
        self.full.requires_grad_(requires_grad)
        # Collectives bump a tensor's version counter, which would invalidate the views autograd
        # saved in forward. ``.data`` aliases the same storage with its own counter.
        self._full_data = self.full.data
        self.full.untyped_storage().resize_(0)  # allocated again by each gather
        # The split of ``full`` into the parameters' views: padding pieces between them too.
        self._split_sizes, self._origin_pieces = split_plan(origins, self.padded_numel)
        self.gather: Optional[InFlightGather] = None
        self.is_unsharded = False
        self._views_version = 0  # ``full``'s version counter when the views were made
        # Each original parameter stays a parameter of its module: this rank's part of it, a
        # view of the shard (``local_params[i]``, empty where the rank holds none of it).
        self.local_params = self._make_local_params()
        self._show_local_params()
        # gradients of the local parameters, no_sync micro-batches, recovery (shard_grad.py)
        self.shard_grad = ShardGrad(self.local_params, self.local_slices(), len(origins))

    # -- the groups ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks of the shard group: the flat vector is cut into this many shards."""
        return self.groups.size

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered flat vector: ``shard_numel`` per rank of the shard group."""
        return self.shard_numel * self.world_size

    def local_slices(self) -> List[Tuple[int, int, int, int]]:
        """(origin index, start in the shard, start in the parameter, length) of every original
        parameter this rank holds elements of (``shard_slices``; the layout never changes)."""
        if self._local_slices is None:
            self._local_slices = shard_slices(self.origins, self.shard_numel, self.rank)
        return self._local_slices

    def held_tensors(self):
        """Every tensor this handle keeps alive: the shard and its gradient, the gathered weights
        and their gradient, the ``no_sync`` accumulator, an in-flight gather's source."""
        yield self.shard
        for tensor in (self.shard.grad, self.full, self.full.grad):
            if tensor is not None:
                yield tensor
        yield from self.shard_grad.tensors()
        if self.gather is not None:
            yield self.gather.source

    # -- construction ---------------------------------------------------------------------
    def _own_shard(self, params, device, sync: bool) -> torch.Tensor:
        """(shard_numel,) this rank's slice of the flat vector, built one parameter at a time:
        never the whole flat vector (a unit of a big model can be hundreds of MiB), at most one
        parameter's full values (with ``sync`` broadcast from the group's first rank)."""
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        shard = torch.zeros(hi - lo, dtype=self.param_dtype, device=device)
        src = dist.get_global_rank(self.groups.shard, 0)
        with torch.no_grad():
            for p, o in zip(params, self.origins):
                # a parameter built on the meta device is created (and initialised) only now
                value = materialize(p).reshape(-1).to(device)
                if sync and self.world_size > 1:
                    value = value.clone() if value.data_ptr() == p.data_ptr() else value  # not the user's
                    dist.broadcast(value, src=src, group=self.groups.shard)
                start, end = max(lo, o.flat_offset), min(hi, o.flat_offset + o.numel)
                if start < end:
                    shard[start - lo : end - lo].copy_(value[start - o.flat_offset : end - o.flat_offset])
        return shard

    # -- gather / free ------------------------------------------------------------------------
    def _free_full(self) -> int:
        nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        return nbytes

    def start_unshard(self) -> int:
        """Launch the all-gather of the full flat vector (asynchronous); no-op when already there.

        Returns the bytes this allocated for ``full`` (0 when it was gathered or in flight).
        """
        if self.is_unsharded or self.gather is not None:
            return 0
        self.local_views_intact()
        nbytes = self.full.numel() * self.full.element_size()
        self.full.untyped_storage().resize_(nbytes)
        src = self.shard.detach().to(self.compute_device, self.compute_dtype, non_blocking=True)
        group = self.gather_group or self.groups.shard
        work = gather_into(self._full_data, src, group, async_op=True)
        self.gather = InFlightGather(work, src, version_counter(self.shard))
        return nbytes

    def _finish_gather(self) -> None:
        gather, self.gather = self.gather, None
        wait_within(gather.work, self.timeout, self._gather_description, self.compute_device)

    def wait_unshard(self) -> int:
        """Finish the gather; the modules then see views of ``full`` (also code that autograd
        re-runs in backward, such as activation checkpointing inside the unit). Returns the
        bytes allocated here (when no gather had been started)."""
        if self.is_unsharded:
            return 0
        prefetched = self.gather is not None
        nbytes = self.start_unshard()
        if prefetched:
            self.local_views_intact()
            if version_counter(self.shard) != self.gather.shard_version:
                # written after the prefetch started (code between units: an EMA, a
                # normalisation); every rank runs the same code, so every rank gathers again
                self._finish_gather()
                self.start_unshard()
        self._finish_gather()
        self.is_unsharded = True
        self.set_views()
        return nbytes

    def reshard(self) -> int:
        """Free the full weights, including those of a prefetch that was never used; returns
        the bytes freed."""
        freed = 0
        if self.gather is not None:
            self._finish_gather()
            freed += self._free_full()
        if self.is_unsharded:
            self._write_back_in_place_changes()
            freed += self._free_full()
            self.is_unsharded = False
            self._show_local_params()
        return freed

    def _write_back_in_place_changes(self) -> None:
        """Code that wrote into the gathered weights in place (under no_grad, inside a forward:
        a LightningModule's ``training_step`` runs inside the root's) wrote the same on every
        rank: this rank's part goes back into the shard (in the compute dtype's precision)."""
        if version_counter(self.full) == self._views_version:
            return
        lo = self.rank * self.shard_numel
        with torch.no_grad():
            self.shard.copy_(self._full_data[lo : lo + self.shard_numel])

    def _gather_description(self) -> str:
        return f"the all-gather of {self.describe()}"

    def describe(self) -> str:
        names = [o.fqn or o.local_fqn for o in self.origins]
        return f"flat parameter [{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}]"

    def set_views(self) -> None:
        """Point every original parameter attribute at fresh views of ``full`` (must be gathered).

        One ``split`` for all views: its backward concatenates the parameters' gradients into
        one flat gradient, where separate slices would each materialise a full-size zero tensor.
        """
        pieces = torch.split(self.full, self._split_sizes)
        if pieces[0].grad_fn is not None:
            # the split's backward gets None for each view that received no gradient: one hook
            # per gather tells which original parameters this rank used
            pieces[0].grad_fn.register_prehook(self._note_used)
        views = [pieces[k].view(o.shape) for k, o in zip(self._origin_pieces, self.origins)]
        self._set_attributes(views)
        self._views_version = version_counter(self.full)

    def _note_used(self, grad_outputs) -> None:
        self.shard_grad.note_used([grad_outputs[k] for k in self._origin_pieces])

    def restore_attributes(self) -> None:
        """After summon_full_params: views when gathered for compute, else placeholders."""
        self._show_local_params()
        if self.is_unsharded:
            self.set_views()

    def _set_attributes(self, tensors) -> None:
        # Instance attributes shadow the registered local parameters while the unit computes
        # (``module.weight`` is then the full view); writing __dict__ directly skips
        # nn.Module.__setattr__'s checks on this hot path.
        for o, tensor in zip(self.origins, tensors):
            for module, attr in o.places():
                module.__dict__[attr] = tensor

    def _show_local_params(self) -> None:
        """Outside compute the modules' attributes are this rank's local parameters."""
        for o, param in zip(self.origins, self.local_params):
            for module, attr in o.places():
                module.__dict__.pop(attr, None)
                own_parameters(module)[attr] = param

    def _make_local_params(self) -> List[nn.Parameter]:
        """One parameter per origin viewing this rank's part of it in the shard: whole rows
        keep the original trailing dims (``flat_layout`` aligns them), so row-wise code works."""
        out = []
        held = {i: (s_start, p_start, n) for i, s_start, p_start, n in self.local_slices()}
        shard = self.shard.detach()
        for i, o in enumerate(self.origins):
            s_start, p_start, n = held.get(i, (0, 0, 0))
            shape = (
                local_shape(o.shape, p_start, n) if n else ((0,) + tuple(o.shape[1:]) if o.shape else (0,))
            )
            param = nn.Parameter(shard[s_start : s_start + n].view(shape), requires_grad=o.requires_grad)
            register_local_param(param, self, i)
            out.append(param)
        return out

    def local_views_intact(self) -> None:
        """Put back what code outside forward assigned with ``p.data = ...``: its values go
        into the shard and ``p`` views the shard again (in-place writes need nothing). Called
        before every gather: one pointer comparison per local parameter."""
        ptr, size = self.shard.data_ptr(), self.shard.element_size()
        for i, s_start, _, n in self.local_slices():
            param = self.local_params[i]
            if param.data_ptr() == ptr + s_start * size and param.numel() == n:
                continue
            view = self.shard.detach()[s_start : s_start + n]
            if param.numel() != n:
                raise ValueError(
                    f"parameter {self.origins[i].fqn or self.origins[i].local_fqn} was given "
                    f"{param.numel()} elements outside forward; this rank holds {n} of it "
                    "(write with p.data.copy_(...) or under summon_full_params())"
                )
            with torch.no_grad():
                view.copy_(param.data.reshape(-1))
            param.data = view.view(param.shape)

    def expose_as_parameters(self, source: torch.Tensor) -> None:
        """Register views of ``source`` (a full copy) as ordinary parameters of their modules
        (until :meth:`restore_attributes`)."""
        for o in self.origins:
            param = nn.Parameter(source[o.flat_offset : o.flat_offset + o.numel].view(o.shape), False)
            for module, attr in o.places():  # a tied parameter stays one object in every place
                module.__dict__.pop(attr, None)
                own_parameters(module)[attr] = param

    def gather_full_copy(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A fresh (padded_numel,) tensor with the full values, in the master dtype by default."""
        dtype = dtype or self.param_dtype
        self.local_views_intact()
        out = torch.empty(self.padded_numel, dtype=dtype, device=self.compute_device)
        gather_into(out, self.shard.detach().to(self.compute_device, dtype), self.groups.shard, False)
        return out

    def write_back(self, full_copy: torch.Tensor) -> None:
        lo = self.rank * self.shard_numel
        with torch.no_grad():
            self.shard.copy_(full_copy[lo : lo + self.shard_numel])

    # -- gradients ----------------------------------------------------------------------------
    def take_full_grad(self) -> Optional[torch.Tensor]:
        grad, self.full.grad = self.full.grad, None
        return grad

    def start_reduce_scatter(self, grad: torch.Tensor, reduce_group):
        """Sum ``grad`` (padded_numel,) / (world_size * replicas) over ranks on ``reduce_group``
        (the ranks of the shard group, its own queue); returns (work, output shard, kept input).
        Without replicas the output is the average; with them, :meth:`start_replica_all_reduce`
        completes it."""
        grad = self.shard_grad.with_accumulated(grad).to(self.reduce_dtype)
        if self.world_size * self.groups.replicas > 1:
            # Dividing before the sum keeps fp16 sums in range; DDP divides after. Same maths.
            grad.div_(self.world_size * self.groups.replicas)
        lo = self.rank * self.shard_numel
        work, out = reduce_scatter_into(grad, lo, lo + self.shard_numel, reduce_group)
        return work, out, grad

    def start_replicated_all_reduce(self, grad: torch.Tensor, reduce_group):
        """Shard groups of one rank: sum ``grad`` (padded_numel,) / replicas over the replicas on
        ``reduce_group`` in place; returns (work, the tensor that holds the average once waited)."""
        grad = self.shard_grad.with_accumulated(grad).to(self.reduce_dtype)
        grad.div_(self.groups.replicas)
        return dist.all_reduce(grad, group=reduce_group, async_op=True), grad

    def start_replica_all_reduce(self, reduced: torch.Tensor, reduce_group):
        """Sum a finished reduce-scatter's shard (shard_numel,) over the replicas on
        ``reduce_group`` (the ranks of the replica group, its own queue); returns (work, tensor):
        the world's average once ``work`` is waited. The shard is copied out first, so gloo's
        full-size buffer (``reduced`` is a view of it) dies now."""
        shard = own_shard_grad(reduced, reduced.device, reduced.dtype)
        return dist.all_reduce(shard, group=reduce_group, async_op=True), shard

    def accumulate_unsharded(self, grad: torch.Tensor) -> None:
        """no_sync: keep the full gradient locally (param dtype), reduce it with the next synced
        backward (kept with ``shard.grad``: clearing it drops them, ``shard_grad.py``)."""
        self.shard_grad.keep_unsharded(grad.to(self.param_dtype))
