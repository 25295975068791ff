"""FullyShardedDataParallel: a drop-in replacement for DistributedDataParallel that shards state.

One instance is one *unit*: the parameters of its wrapped module that are not inside a nested
unit. Per training step and unit::

    forward:   all-gather shards -> run module -> free full weights (reshard_after_forward)
    backward:  (hook on the unit's outputs, and on unpacking its saved weights) all-gather again
               -> autograd runs the unit's backward
               -> (hook after the gradient is accumulated) reduce-scatter it, free full weights
    end:       the root waits for outstanding reductions; shard.grad holds the averaged gradient

With the same seed and data the results equal DDP's: same losses, same parameters. This class is
the ``nn.Module`` shell: a unit's handles, phase and transitions live in its ``UnitState``
(``unit_state.py``), what the units share in the ``ModelState`` the root builds at its first
forward (``model_state.py``); cross-rank checks in ``agreement.py``; reductions in
``reductions.py``; buffer broadcasts in ``buffers.py``; collective timeouts in ``timeouts.py``.
"""

import contextlib
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from vistrain.fsdp import registry
from vistrain.fsdp.deferred_init import materialize
from vistrain.fsdp.flat_param import FlatParamHandle, ParamOrigin
from vistrain.fsdp.grad import clip_grad_norm_
from vistrain.fsdp.heap import release_free_pages
from vistrain.fsdp.mixed_precision import cast_floating, default_compute_dtype, low_precision_dtype
from vistrain.fsdp.model_state import ModelState, RootOptions
from vistrain.fsdp.names import FLAT_PARAM_PREFIX, WRAPPED_NAME, clean_name
from vistrain.fsdp.optim_in_backward import OptimizerInBackward
from vistrain.fsdp.ownership import check_wrappable, compute_device, owned_modules, owned_params
from vistrain.fsdp.phases import Phase
from vistrain.fsdp.state_dict import (
    full_state_dict,
    load_as_child,
    load_full_state_dict,
    local_mode,
    positional_state_dict_args,
    summon,
)
from vistrain.fsdp.timeouts import DEFAULT_COLLECTIVE_TIMEOUT, as_timedelta
from vistrain.fsdp.unit_state import UnitState
from vistrain.torch_compat import own_buffers


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over ``process_group``.

    Args (FairScale names):
        process_group: ranks sharing the shards (default: all).
        reshard_after_forward: free the gathered weights after forward (ZeRO-3); else keep them
            until the end of backward (ZeRO-2: one gather per step instead of two).
        mixed_precision: gather and compute in ``compute_dtype``; shards stay fp32 masters.
            A unit without it gathers fp32 weights, upcasts fp16/bf16 inputs to fp32 and casts
            its outputs back to the incoming dtype (a full-precision island).
        fp32_reduce_scatter: reduce gradients in fp32 under mixed precision.
        flatten_parameters: one flat tensor per parameter group; False: one per parameter.
        compute_dtype: float16 / bfloat16 (default: float16 on CUDA, bfloat16 on CPU).
        buffer_dtype: cast floating buffers to this dtype (default: leave them as they are).
        move_params_to_cpu: shards, gradients and optimizer state live in CPU memory; compute
            runs on the current CUDA device.
        sync_module_states: broadcast parameters and buffers from the group's first rank.
        param_group_fn: ``fn(fqn, module, param) -> key``; parameters with different keys are
            never flattened together, so optimizer groups (no weight decay on BN...) survive.
        keep_fp32: run this unit entirely in fp32 with autocast off (BatchNorm under AMP).
        broadcast_buffers: before each training forward, copy the first rank's buffers to every
            rank (DDP's default), so BatchNorm statistics and ``state_dict()`` agree. Root only.
        find_unused_parameters: allow units whose outputs do not reach the loss on some ranks
            (as DDP's option): weights stay gathered until the end of backward (ZeRO-2) and
            gradients are reduced at its end, after agreeing which ones any rank produced. Root only.
        collective_timeout: seconds (or a timedelta) after which a waited collective of this
            unit raises instead of hanging (ranks that ran different units). Default 5 minutes.
        release_host_memory: on CPU, give free heap pages back to the OS once this unit is built
            and (the root's setting) at unit boundaries once enough gathered weights and
            gradients were freed (glibc ``malloc_trim``, see ``heap.py``).
        replica_group: hybrid sharding (FSDP's HYBRID_SHARD): the ranks holding the same shards
            as this one in the other shard groups (``process_group`` is then this rank's shard
            group, e.g. its node). Each shard gradient is all-reduced over it after the
            reduce-scatter, so gradients are averaged over the whole world; buffers and the
            first step's check go over both groups. ``vistrain.fsdp.hybrid_groups(k)`` makes
            both. Every unit of a model takes the same one.
        prefetch_depth: how many of the next units (in the first step's execution order) this
            unit starts gathering when it runs, forward and backward: 0 gathers each unit only
            when it runs; each step of depth keeps one more unit's full weights alive.
    """

    is_sharded_unit = True

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        reshard_after_forward: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        move_params_to_cpu: bool = False,
        sync_module_states: bool = True,
        param_group_fn: Optional[Callable] = None,
        keep_fp32: bool = False,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT,
        release_host_memory: bool = True,
        replica_group=None,
        prefetch_depth: int = 1,
    ):
        check_wrappable(module)
        super().__init__()
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if replica_group is not None and dist.get_rank(replica_group) < 0:
            raise ValueError("replica_group must contain this rank (the ranks holding its shards)")
        self.replica_group = replica_group
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.reshard_after_forward = reshard_after_forward
        self.keep_fp32 = keep_fp32
        self.mixed_precision = mixed_precision and not keep_fp32
        self.compute_device = compute_device(module, move_params_to_cpu)
        self.compute_dtype = (
            compute_dtype or default_compute_dtype(self.compute_device) if self.mixed_precision else None
        )
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.move_params_to_cpu = move_params_to_cpu
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.collective_timeout = as_timedelta(collective_timeout)
        self.release_host_memory = release_host_memory
        self.add_module(WRAPPED_NAME, module)

        owned = list(owned_params(module))
        handles = self._build_handles(owned, flatten_parameters, param_group_fn, sync_module_states)
        for i, handle in enumerate(handles):
            self.register_parameter(f"{FLAT_PARAM_PREFIX}{i}", handle.shard)
        keep_gathered = not reshard_after_forward or find_unused_parameters
        if prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth
        self._unit = UnitState(handles, keep_gathered, prefetch_depth)
        self._prepare_buffers(buffer_dtype if not keep_fp32 else None, sync_module_states)
        for sub in owned_modules(module):
            registry.set_owner(sub, self)
        self._assign_root_names()
        if release_host_memory and self.compute_device.type == "cpu":
            release_free_pages()  # the materialised parameters and the flat copy (heap.py)

    # -- construction helpers -------------------------------------------------------------------
    def _build_handles(self, owned, flatten, group_fn, sync) -> List[FlatParamHandle]:
        groups: Dict[tuple, list] = {}
        for fqn, sub, attr, param, aliases in owned:
            key = (param.requires_grad, param.dtype, group_fn(fqn, sub, param) if group_fn else None)
            if not flatten:
                key = key + (fqn,)
            groups.setdefault(key, []).append((fqn, sub, attr, param, aliases))
        reduce_dtype = torch.float32 if self.fp32_reduce_scatter else None
        shard_device = torch.device("cpu") if self.move_params_to_cpu else self.compute_device
        handles = []
        for members in groups.values():
            origins, offset = [], 0
            for fqn, sub, attr, param, aliases in members:
                origins.append(ParamOrigin(fqn, sub, attr, param.shape, offset, aliases=aliases))
                offset += param.numel()
            params = [m[3] for m in members]
            handles.append(
                FlatParamHandle(
                    params,
                    origins,
                    self.process_group,
                    self.compute_device,
                    self.compute_dtype,
                    reduce_dtype,
                    shard_device,
                    sync,
                    self.collective_timeout,
                    self.replica_group,
                )
            )
            for param, origin in zip(params, origins):
                registry.mark_replaced(param, self, origin.local_fqn)  # an optimizer on it fails
        return handles

    def _prepare_buffers(self, buffer_dtype, sync: bool) -> None:
        for sub in owned_modules(self.module):
            buffers = own_buffers(sub)
            for name, buf in list(buffers.items()):
                if buf is None:
                    continue
                buf = materialize(buf).to(self.compute_device)
                if buffer_dtype is not None and buf.is_floating_point():
                    buf = buf.to(buffer_dtype)
                if sync:
                    for group in (self.process_group, self.replica_group):
                        if group is not None and dist.get_world_size(group) > 1:
                            dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
                buffers[name] = buf

    def _assign_root_names(self) -> None:
        for handle in self._unit.handles:
            for o in handle.origins:
                o.fqn = o.local_fqn
        for name, sub in self.module.named_modules():
            if isinstance(sub, FullyShardedDataParallel) and sub is not self:
                prefix = clean_name(name)
                for handle in sub.unit_state.handles:
                    for o in handle.origins:
                        o.fqn = f"{prefix}.{o.local_fqn}" if prefix else o.local_fqn

    @property
    def module(self) -> nn.Module:
        """The wrapped module (FairScale name)."""
        return self._modules[WRAPPED_NAME]

    def __getattr__(self, name: str):
        """Attributes the wrapper lacks come from the wrapped module, as with FairScale."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_NAME or WRAPPED_NAME not in self._modules:
                raise
            return getattr(self._modules[WRAPPED_NAME], name)

    def units(self) -> List["FullyShardedDataParallel"]:
        """This unit and every nested one, outermost first."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

    @property
    def unit_state(self) -> UnitState:
        """This unit's handles, phase and transitions."""
        return self._unit

    @property
    def model_state(self) -> Optional[ModelState]:
        """What the units of the wrapped model share; None before the root's first forward."""
        return self._unit.model

    # -- forward ----------------------------------------------------------------------------------
    def _lazy_init(self) -> ModelState:
        """At the root's first forward: the ModelState of every unit below (collective)."""
        if self._unit.model is None:
            units = self.units()
            names = {id(u): clean_name(n) or "<root>" for n, u in self.named_modules() if u in units}
            options = RootOptions(
                self.process_group,
                self.compute_device,
                self.broadcast_buffers,
                self.find_unused_parameters,
                self.collective_timeout,
                self.release_host_memory,
                self.replica_group,
            )
            ModelState(
                options,
                [u.unit_state for u in units],
                [names[id(u)] for u in units],
                [u.module for u in units],
            )
        return self._unit.model

    def forward(self, *args, **kwargs):
        self._lazy_init()
        training = self._unit.begin_forward()
        outputs = self._run_module(args, kwargs)
        return self._unit.end_forward(outputs, training)

    def _run_module(self, args, kwargs):
        if self.mixed_precision:
            args, kwargs = cast_floating((args, kwargs), self.compute_dtype)
        incoming = None if self.mixed_precision else low_precision_dtype((args, kwargs))
        if incoming is not None:  # a full-precision island inside a mixed-precision network
            args, kwargs = cast_floating((args, kwargs), torch.float32, only_low_precision=True)
        with contextlib.ExitStack() as stack:
            if self.keep_fp32:
                stack.enter_context(_autocast_off(self.compute_device))
            if torch.is_grad_enabled():
                stack.enter_context(self._unit.model.saved_weight_hooks())
            outputs = self.module(*args, **kwargs)
        if incoming is not None:  # hand the parent back the precision it computes in
            outputs = cast_floating(outputs, incoming, only_full_precision=True)
        return outputs

    def _root_model_state(self, what: str) -> ModelState:
        model = self._lazy_init()
        if not self._unit.is_root:
            raise RuntimeError(f"{what} must be called on the root FullyShardedDataParallel")
        return model

    def reset_iter_state(self) -> None:
        """Recover from an exception in forward or backward: discard the step's gradients and
        free every gathered weight (done automatically by the next forward). Root only."""
        self._root_model_state("reset_iter_state()").reset()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block; root only."""
        with self._root_model_state("no_sync()").no_sync():
            yield

    def apply_optimizer_in_backward(self, optimizer) -> OptimizerInBackward:
        """Step ``optimizer`` (built on ``self.parameters()``) on each shard as soon as its
        gradient is final in backward, then free that gradient (``optim_in_backward.py``); do not
        call ``optimizer.step()`` / ``zero_grad()`` yourself. Root only; collective the first
        time (every rank binds at the same point). Returns the binding (``freeze(params)``)."""
        binding = OptimizerInBackward(optimizer)
        self._root_model_state("apply_optimizer_in_backward()").step_in_backward(binding.step_shard)
        return binding

    # -- full parameters ------------------------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True):
        """Make the full fp32 parameters visible as ordinary ``nn.Parameter`` s inside the block.

        Collective: every rank must enter. Changes are written back to the shards on exit when
        ``writeback``. Not allowed during forward or backward.
        """
        if self._unit.model is not None:
            self._unit.model.recover_if_interrupted()
        with summon(self, recurse, writeback):
            yield

    # -- state dicts, gradients (implemented in state_dict.py / grad.py) ---------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full state dict: keys and shapes of the unwrapped module. Collective.

        As ``nn.Module.state_dict``: entries go into ``destination`` (a new ``OrderedDict`` when
        None) under ``prefix``, so a plain module holding this unit (``self.net = FSDP(...)``)
        gets every key. The values are gathered copies; ``keep_vars`` has no live tensor to keep.
        """
        destination, prefix, keep_vars = positional_state_dict_args(args, destination, prefix, keep_vars)
        if self._unit.phase in (Phase.LOCAL, Phase.SUMMONED):
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self._unit.model is not None:
            self._unit.model.recover_if_interrupted()
        return full_state_dict(self, super().state_dict, destination, prefix)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full (unwrapped-module) state dict. Collective."""
        if self._unit.phase is Phase.LOCAL:
            return super().load_state_dict(state_dict, strict)
        return load_full_state_dict(self, state_dict, strict, super().state_dict)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # Reached by a plain parent's load_state_dict (as a child, under ``prefix``): load the
        # unwrapped module's keys here, then leave what the parent's recursion expects below
        # this unit (shards and buffers at their internal names, holding the loaded values).
        if WRAPPED_NAME not in prefix and self._unit.phase is Phase.IDLE:
            load_as_child(self, state_dict, prefix, missing, unexpected)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def local_state_dict(self):
        """This rank's shards and buffers, keyed by wrapper-internal names."""
        with local_mode(self):
            return self.state_dict()

    def load_local_state_dict(self, state_dict, strict: bool = True):
        with local_mode(self):
            return self.load_state_dict(state_dict, strict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over every shard on every rank; returns the norm.

        Reduced over the shard group only: with hybrid sharding every replica holds the same
        (already world-averaged) shard gradients, so one replica's shards are the whole model."""
        return clip_grad_norm_(
            list(self.parameters()), max_norm, norm_type, self.process_group, self.compute_device
        )


def _autocast_off(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)
