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
(``unit.py``), what the units share in the ``ModelState`` the root builds at its first forward
(``model_state.py``).
"""

import contextlib
import inspect
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from vistrain.fsdp.collectives import ShardGroups
from vistrain.fsdp.forward_methods import (
    gathered_call,
    gathers_by_itself,
    guarded_call,
    register_forward_method,
)
from vistrain.fsdp.gathered_writes import WriteGuard
from vistrain.fsdp.grads import OptimizerInBackward, clip_grad_norm_
from vistrain.fsdp.model_state import ModelState, RootOptions, release_free_pages
from vistrain.fsdp.ownership import (
    WRAPPED_NAME,
    check_wrappable,
    clean_name,
    compute_device,
    forward_methods_of,
    owned_modules,
    owned_params,
    set_owner,
)
from vistrain.fsdp.precision import (
    FULL_PRECISION,
    Precision,
    ShardedGradScaler,
    cast_floating,
    low_precision_dtype,
)
from vistrain.fsdp.state_dict import (
    full_state_dict,
    load_as_child,
    load_full_state_dict,
    positional_state_dict_args,
    summon,
)
from vistrain.fsdp.unit import Phase, UnitState, build_handles, name_from_root, prepare_buffers


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over ``groups``.

    Args:
        groups: the ranks sharing the shards (default: all), and with hybrid sharding the ranks
            holding the same shards in the other groups (``vistrain.fsdp.hybrid_groups(k)``).
            Every unit of a model takes the same ones.
        reshard_after_forward: free the gathered weights after forward (ZeRO-3); else keep them
            until the end of backward (ZeRO-2: one gather per step instead of two).
        precision: the dtypes this unit gathers, computes and reduces in (:class:`Precision`);
            the shards stay in the parameters' dtype.
        flatten_parameters: one flat tensor per parameter group; False: one per parameter.
        move_params_to_cpu: shards, gradients and optimizer state live in CPU memory; compute
            runs on the current CUDA device.
        sync_module_states: broadcast parameters and buffers from the world's first rank.
        param_group_fn: ``fn(fqn, module, param) -> key``; parameters with different keys are
            never flattened together (optimizer param groups need none of this: they hold the
            original parameters, ``docs/engine.md``).
        root: the whole model's options (:class:`RootOptions`); only the outermost unit may take them.
        forward_methods: names of the module's methods that gather the weights as ``forward``
            does (``unit.encode(...)``; ``forward_methods.py``). Any other method reached
            through the unit runs on the shards and may not mix them with other tensors.
        gather_public_methods: also gather around every public method the wrapped module's own
            class defines (``forward_features``, ``encode``...; not ``nn.Module``'s or torch
            layers', ``forward_methods.gathers_by_itself``), no registration needed; an in-place
            write into the weights gathered for such a call lands in the shards at once, under
            mixed precision it raises ``GatheredWriteError`` (``gathered_writes.py``).
    """

    is_sharded_unit = True

    def __init__(
        self,
        module: nn.Module,
        groups: Optional[ShardGroups] = None,
        reshard_after_forward: bool = True,
        precision: Precision = FULL_PRECISION,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        sync_module_states: bool = True,
        param_group_fn: Optional[Callable] = None,
        root: Optional[RootOptions] = None,
        forward_methods: Sequence[str] = (),
        gather_public_methods: bool = False,
    ):
        check_wrappable(module)
        super().__init__()
        self._groups = groups if groups is not None else ShardGroups()
        self._precision = precision
        self._device = compute_device(module, move_params_to_cpu)
        self._root_options = root
        self._gather_public_methods = gather_public_methods
        self.add_module(WRAPPED_NAME, module)
        shard_device = torch.device("cpu") if move_params_to_cpu else self._device
        handles = build_handles(
            self, owned_params(module), self._groups, precision, (self._device, shard_device),
            flatten_parameters, param_group_fn, sync_module_states,
        )  # fmt: skip
        self._unit = UnitState(handles, reshard_after_forward)
        prepare_buffers(module, self._device, self._groups, sync_module_states)
        register_forward_method(
            module, *((forward_methods,) if isinstance(forward_methods, str) else forward_methods)
        )
        for sub in owned_modules(module):
            set_owner(sub, self)
        nested = [
            (clean_name(n), m) for n, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)
        ]
        name_from_root([self._unit] + [m.unit_state for _, m in nested], [""] + [name for name, _ in nested])
        if self._device.type == "cpu":
            release_free_pages()  # the materialised parameters (model_state.py)

    @property
    def module(self) -> nn.Module:
        """The wrapped module (FairScale name)."""
        return self._modules[WRAPPED_NAME]

    def __getattr__(self, name: str):
        """Attributes the wrapper lacks come from the wrapped module, as with FairScale; its
        methods gather the weights when registered as forward methods (or, with
        ``gather_public_methods``, when public methods of its class), else run guarded
        (``forward_methods.py``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_NAME or WRAPPED_NAME not in self._modules:
                raise
            wrapped = self._modules[WRAPPED_NAME]
            found = getattr(wrapped, name)
            if not (inspect.ismethod(found) and found.__self__ is wrapped):
                return found
            if name in forward_methods_of(wrapped):
                return gathered_call(self, name, found)
            if self.gathers_public_methods and gathers_by_itself(wrapped, name):
                return gathered_call(self, name, found, watch_writes=True)
            return guarded_call(self, name, found)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The original parameters (this rank's part of each) under the unwrapped module's names."""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_name(name), param

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

    @property
    def precision(self) -> Precision:
        return self._precision

    @property
    def gathers_public_methods(self) -> bool:
        """The unit gathers around its module's public methods (``gather_public_methods``)."""
        return self._gather_public_methods

    @property
    def root_options(self) -> Optional[RootOptions]:
        """The options given to this unit for the whole model (None: not given)."""
        return self._root_options

    # -- forward ----------------------------------------------------------------------------------
    def _lazy_init(self) -> ModelState:
        """At the root's first forward: the ModelState of every unit below (collective)."""
        if self._unit.model is None:
            units = self.units()
            names = {id(u): clean_name(n) or "<root>" for n, u in self.named_modules() if u in units}
            for unit in units[1:]:
                if unit.root_options is not None:
                    raise ValueError(
                        f"the nested unit {names[id(unit)]} was given the model's root options: "
                        "give them to the outermost unit (auto_wrap(..., root=...))"
                    )
            ModelState(
                self._root_options or RootOptions(), self._groups, self._device,
                [u.unit_state for u in units], [names[id(u)] for u in units], [u.module for u in units],
            )  # fmt: skip
        return self._unit.model

    def forward(self, *args, **kwargs):
        return self.run_as_forward(self.module, args, kwargs)

    def run_as_forward(self, function: Callable, args: tuple, kwargs: dict, watched: Optional[str] = None):
        """``function(*args, **kwargs)`` (the wrapped module, or one of its registered forward
        methods) between the unit's gather and its release, outputs hooked for backward.

        Called while another forward or gathered method of this unit runs (through a reference
        to the unit), it runs plainly: the weights are gathered and the outer call frees them.
        ``watched`` ("Class.method"): under ``WriteGuard`` while gathered."""
        guard = (lambda: WriteGuard(self._unit.handles, watched)) if watched else contextlib.nullcontext
        if self._unit.in_call:
            with guard():
                return function(*args, **kwargs)
        self._lazy_init()
        with self._unit.call():
            training = self._unit.begin_forward()
            with guard():
                outputs = self._run_module(function, args, kwargs)
            return self._unit.end_forward(outputs, training)

    def _run_module(self, function: Callable, args, kwargs):
        precision = self._precision
        if precision.mixed:
            args, kwargs = cast_floating((args, kwargs), precision.compute_dtype)
        incoming = None if precision.mixed else low_precision_dtype((args, kwargs))
        if incoming is not None:  # a full-precision island inside a mixed-precision network
            args, kwargs = cast_floating((args, kwargs), torch.float32, only_low_precision=True)
        with contextlib.ExitStack() as stack:
            if not precision.autocast:
                stack.enter_context(torch.autocast(device_type=self._device.type, enabled=False))
            if torch.is_grad_enabled():
                stack.enter_context(self._unit.model.saved_weight_hooks())
            outputs = function(*args, **kwargs)
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
        gradient is final in backward, then free that gradient (``grads.py``); do not
        call ``optimizer.step()`` / ``zero_grad()`` yourself. Root only; collective the first
        time (every rank binds at the same point). Returns the binding (``freeze(params)``)."""
        model = self._root_model_state("apply_optimizer_in_backward()")
        binding = OptimizerInBackward(optimizer, list(self.parameters()))
        model.step_in_backward(binding)
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

    # -- state dicts, gradients (implemented in state_dict.py / grads.py) ---------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full state dict: keys and shapes of the unwrapped module. Collective.

        As ``nn.Module.state_dict``: entries go into ``destination`` (a new ``OrderedDict`` when
        None) under ``prefix``, so a plain module holding this unit (``self.net = FSDP(...)``)
        gets every key. The values are gathered copies; ``keep_vars`` has no live tensor to keep.
        """
        destination, prefix, keep_vars = positional_state_dict_args(args, destination, prefix, keep_vars)
        if self._unit.phase is Phase.SUMMONED:
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self._unit.model is not None:
            self._unit.model.recover_if_interrupted()
        return full_state_dict(self, super().state_dict, destination, prefix)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full (unwrapped-module) state dict. Collective."""
        return load_full_state_dict(self, state_dict, strict, super().state_dict)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # Reached by a plain parent's load_state_dict (as a child, under ``prefix``): load the
        # unwrapped module's keys here, then leave what the parent's recursion expects below
        # this unit (shards and buffers at their internal names, holding the loaded values).
        if WRAPPED_NAME not in prefix and self._unit.phase is Phase.IDLE:
            load_as_child(self, state_dict, prefix, missing, unexpected)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def grad_scaler(self, **growth) -> ShardedGradScaler:
        """fp16 loss scaling for this model: torch's ``ShardedGradScaler`` on this model's device,
        found-inf flags summed over the shard group; ``growth``: ``init_scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval`` (torch's defaults).

        One rank's overflow may land in another rank's shard only (the reduce-scatter puts each
        element on one rank), so every rank must learn it before stepping. The shard group is
        enough: with hybrid sharding every replica holds the same world-averaged shard
        gradients, so an overflow anywhere is in some shard of every shard group."""
        return ShardedGradScaler(self._device.type, process_group=self._groups.shard, **growth)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over every shard on every rank; returns the norm.

        Reduced over the shard group only: with hybrid sharding every replica holds the same
        (already world-averaged) shard gradients, so one replica's shards are the whole model.
        Not with the step in backward (every shard stepped and freed its gradient already)."""
        model = self._unit.model
        if model is not None and model.binding is not None:
            raise RuntimeError(
                "clip_grad_norm_() cannot clip with the step in backward: each shard was updated and "
                "its gradient freed inside backward (the global norm needs every gradient first); "
                "clip without apply_optimizer_in_backward"
            )
        return clip_grad_norm_(list(self.parameters()), max_norm, norm_type, self._groups.shard, self._device)
