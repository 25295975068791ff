"""FullyShardedDataParallel: a drop-in replacement for DistributedDataParallel that shards state.

One instance is one *unit*: the parameters of its wrapped module that are not inside a nested
unit. Per training step and unit::

    forward:   all-gather shards -> run module -> free full weights (reshard_after_forward)
    backward:  (hook on the unit's outputs, and on unpacking its saved weights) all-gather again
               -> autograd runs the unit's backward
               -> (hook after the gradient is accumulated) reduce-scatter it, free full weights
    end:       the root waits for outstanding reductions; shard.grad holds the averaged gradient

With the same seed and data the results equal DDP's: same losses, same parameters. The states
and their recovery after an exception are described in ``lifecycle.py``; cross-rank checks in
``agreement.py``; buffer broadcasts in ``buffers.py``; collective timeouts in ``timeouts.py``.
"""

import contextlib
import functools
import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from vistrain.fsdp import agreement, lifecycle
from vistrain.fsdp.deferred_init import materialize
from vistrain.fsdp.flat_param import FlatParamHandle, ParamOrigin
from vistrain.fsdp.grad import clip_grad_norm_
from vistrain.fsdp.lifecycle import RootState, TrainingState
from vistrain.fsdp.mixed_precision import cast_floating, default_compute_dtype, low_precision_dtype
from vistrain.fsdp.names import FLAT_PARAM_PREFIX, WRAPPED_NAME, clean_name
from vistrain.fsdp.ownership import (
    check_wrappable,
    compute_device,
    install_optimizer_check,
    owned_modules,
    owned_params,
)
from vistrain.fsdp.state_dict import full_state_dict, load_full_state_dict, local_mode, summon
from vistrain.fsdp.timeouts import DEFAULT_COLLECTIVE_TIMEOUT, as_timedelta
from vistrain.fsdp.tree import iter_tensors


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
    """

    is_sharded_unit = True
    prefetch_depth = 1  # units whose gather starts ahead (memory: 1 + depth units gathered)

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
    ):
        check_wrappable(module)
        super().__init__()
        self.process_group = process_group if process_group is not None else dist.group.WORLD
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
        self.add_module(WRAPPED_NAME, module)

        owned = list(owned_params(module))
        self._handles = self._build_handles(owned, flatten_parameters, param_group_fn, sync_module_states)
        for i, handle in enumerate(self._handles):
            handle.timeout = self.collective_timeout
            self.register_parameter(f"{FLAT_PARAM_PREFIX}{i}", handle.shard)
            if handle.shard.requires_grad:
                handle.full.register_post_accumulate_grad_hook(
                    functools.partial(lifecycle.post_backward_hook, weakref.ref(self), handle)
                )
        self._prepare_buffers(buffer_dtype if not keep_fp32 else None, sync_module_states)
        for sub in owned_modules(module):
            sub._fsdp_owner = weakref.ref(self)
        self._assign_root_names()
        self._root_state: Optional[RootState] = None
        self._is_root: Optional[bool] = None
        self.phase = TrainingState.IDLE
        self._summoned = False
        self._state_dict_mode = "full"
        install_optimizer_check()

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
                )
            )
            for param, origin in zip(params, origins):
                param._fsdp_replaced = True  # an optimizer built on it must fail loudly
                param._fsdp_sharded_as = (weakref.ref(self), origin.local_fqn)
        return handles

    def _prepare_buffers(self, buffer_dtype, sync: bool) -> None:
        for sub in owned_modules(self.module):
            for name, buf in list(sub._buffers.items()):
                if buf is None:
                    continue
                buf = materialize(buf).to(self.compute_device)
                if buffer_dtype is not None and buf.is_floating_point():
                    buf = buf.to(buffer_dtype)
                if sync and self.world_size > 1:
                    dist.broadcast(
                        buf, src=dist.get_global_rank(self.process_group, 0), group=self.process_group
                    )
                sub._buffers[name] = buf

    def _assign_root_names(self) -> None:
        for handle in self._handles:
            for o in handle.origins:
                o.fqn = o.local_fqn
        for name, sub in self.module.named_modules():
            if isinstance(sub, FullyShardedDataParallel) and sub is not self:
                prefix = clean_name(name)
                for handle in sub._handles:
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

    # -- forward ----------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self._root_state is not None:
            return
        units = self.units()
        names = {id(u): clean_name(n) or "<root>" for n, u in self.named_modules() if u in units}
        state = RootState(self, units, names)
        for unit in units:
            unit._root_state, unit._is_root = state, unit is self

    def forward(self, *args, **kwargs):
        self._lazy_init()
        state = self._root_state
        training = torch.is_grad_enabled() and state.phase is not TrainingState.BACKWARD
        if self._is_root:
            lifecycle.begin_root_forward(state, training)
        if training:
            agreement.record_call(self)
        self.phase = TrainingState.FORWARD if training else self.phase
        self._unshard()  # the gather also points the modules at fresh views of the weights
        if training:
            self._prefetch(+1)
        outputs = self._run_module(args, kwargs)
        keep_for_backward = not self.reshard_after_forward or self._is_root or self.find_unused_parameters
        if state.phase is not TrainingState.BACKWARD and (
            not torch.is_grad_enabled() or not keep_for_backward
        ):
            self._reshard()
        if torch.is_grad_enabled():
            for tensor in iter_tensors(outputs):  # an early start; saved-weight hooks guarantee it
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook)
        if training:
            self.phase = TrainingState.IDLE
        if self._is_root and training:
            agreement.check_unit_call(state, self.process_group, agreement.END)
            state.phase = TrainingState.IDLE
        return outputs

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
                stack.enter_context(lifecycle.saved_weight_hooks(self._root_state))
            outputs = self.module(*args, **kwargs)
        if incoming is not None:  # hand the parent back the precision it computes in
            outputs = cast_floating(outputs, incoming, only_full_precision=True)
        return outputs

    def reset_iter_state(self) -> None:
        """Recover from an exception in forward or backward: discard the step's gradients and
        free every gathered weight (done automatically by the next forward). Root only."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("reset_iter_state() must be called on the root FullyShardedDataParallel")
        lifecycle.reset_iter_state(self._root_state)

    def _unshard(self) -> None:
        for handle in self._handles:
            handle.start_unshard()
        for handle in self._handles:
            handle.wait_unshard()

    def _reshard(self) -> None:
        for handle in self._handles:
            handle.reshard()

    def _prefetch(self, step: int) -> None:
        """Start the all-gathers of the units that run next (+1 in forward, -1 in backward)."""
        state = self._root_state
        if not state.exec_order_final or self not in state.exec_order:
            return
        idx = state.exec_order.index(self)
        for distance in range(1, self.prefetch_depth + 1):
            j = idx + distance * step
            if 0 <= j < len(state.exec_order):
                nxt = state.exec_order[j]
                if step > 0 or nxt.phase is not TrainingState.BACKWARD:
                    for handle in nxt._handles:
                        handle.start_unshard()

    # -- backward -----------------------------------------------------------------------------
    def _pre_backward_hook(self, grad):
        self._gather_for_backward()
        return grad

    def _gather_for_backward(self) -> None:
        """Before the unit's backward reads its weights (output hook or saved-weight unpack)."""
        state = self._root_state
        lifecycle.mark_backward(state)
        if self.phase is not TrainingState.BACKWARD:
            self.phase = TrainingState.BACKWARD
            agreement.check_backward_call(state, state.units.index(self))
            self._unshard()
            self._prefetch(-1)

    def _finalize_backward(self) -> None:
        """Root only, once per backward: finish reductions, free everything, back to IDLE."""
        state = self._root_state
        agreement.check_backward_call(state, agreement.END)
        if state.deferred or (self.find_unused_parameters and state.require_grad_sync):
            lifecycle.reduce_deferred(state, self.process_group)
        lifecycle.finish_reductions(state)
        for unit in state.units:
            unit._reshard()
            unit.phase = TrainingState.IDLE
        state.phase = TrainingState.IDLE
        state.exec_order_final = bool(state.exec_order)
        state.order_checked = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block; root only."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("no_sync() must be called on the root FullyShardedDataParallel")
        state = self._root_state
        previous, state.require_grad_sync = state.require_grad_sync, False
        try:
            yield
        finally:
            state.require_grad_sync = previous

    # -- full parameters ------------------------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True):
        """Make the full fp32 parameters visible as ordinary ``nn.Parameter`` s inside the block.

        Collective: every rank must enter. Changes are written back to the shards on exit when
        ``writeback``. Not allowed during forward or backward.
        """
        lifecycle.recover_if_interrupted(self._root_state)
        with summon(self, recurse, writeback):
            yield

    # -- state dicts, gradients (implemented in state_dict.py / grad.py) ---------------------------
    def state_dict(self, *args, **kwargs):
        """The full state dict: keys and shapes of the unwrapped module. Collective."""
        lifecycle.recover_if_interrupted(self._root_state)
        if self._state_dict_mode == "local" or self._summoned:
            return super().state_dict(*args, **kwargs)
        return full_state_dict(self, super().state_dict)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full (unwrapped-module) state dict. Collective."""
        if self._state_dict_mode == "local":
            return super().load_state_dict(state_dict, strict)
        return load_full_state_dict(self, state_dict, strict, super().state_dict)

    def local_state_dict(self):
        """This rank's shards and buffers, keyed by wrapper-internal names."""
        with local_mode(self):
            return self.state_dict()

    def load_local_state_dict(self, state_dict, strict: bool = True):
        with local_mode(self):
            return self.load_state_dict(state_dict, strict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over every shard on every rank; returns the norm."""
        return clip_grad_norm_(
            list(self.parameters()), max_norm, norm_type, self.process_group, self.compute_device
        )


def _autocast_off(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)
