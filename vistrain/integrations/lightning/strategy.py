"""``VistrainFSDPStrategy``: Lightning's Trainer training on vistrain's sharded engine.

It is Lightning's ``DDPStrategy`` (launcher, process group, collectives, samplers) with the model
sharded instead of replicated, and each place where Lightning's defaults assume whole
parameters made right for shards:

    configure_optimizers  runs on the plain module (as under DDP); each param group is then
                          pointed at the engine's local parameters in place of the originals
    training_step         through the root unit's forward (automatic optimization); manual
                          optimization opens the root first, then runs the step as written
    self.backbone.encode  a unit's public methods gather its weights as its forward does
                          (``gather_public_methods``): masked-image clients train unmodified
    gradient_clip_val     the global norm over every rank's shards (the precision plugin)
    16-mixed              the sharded grad scaler on the run's device
    sync_batchnorm        vistrain's synchronised BatchNorm, on CPU too (``layer_sync.py``)
    accumulate_grad_*     the engine's no_sync
    checkpoints           vistrain's sharded, world-size independent folders (``checkpoint.py``)
    teardown              the full model gathered back into the plain LightningModule

Every engine call goes through ``engine.py``.
"""

import contextlib
from datetime import timedelta
from typing import Any, Dict, Optional

from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn

from vistrain.integrations.lightning import checkpoint as ckpt
from vistrain.integrations.lightning.engine import (
    bind_step_in_backward,
    broadcast_buffers,
    build_policy,
    is_wrapped,
    no_sync,
    open_step,
    parameter_places,
    point_optimizers_at_shards,
    root_owned_names,
    unit_option_names,
    unit_precision,
    unwrap,
    wrap,
)
from vistrain.integrations.lightning.errors import StrategyError
from vistrain.integrations.lightning.layer_sync import with_sharded_sync
from vistrain.integrations.lightning.precision import ShardedPrecision, sharded_precision


class VistrainFSDPStrategy(DDPStrategy):
    """Shard the LightningModule with vistrain's engine; everything else as ``DDPStrategy``.

    Args:
        auto_wrap_policy: which submodules become units of their own. None: each immediate
            child of the LightningModule that holds parameters (the items of a ``ModuleList`` or
            ``ModuleDict`` child, which code indexes and never calls); module classes (a list, or
            ``{cls: unit options}``); a minimum parameter count; or an engine policy
            (``vistrain.fsdp.by_class(...)``; ``start_method="spawn"`` pickles the strategy, so
            give classes there). The root unit wraps the whole LightningModule.
        reshard_after_forward: free a unit's gathered weights after its forward (ZeRO-3);
            False keeps them until its backward (ZeRO-2: one gather per step instead of two).
        mixed_precision: True: the engine gathers and computes in bf16 on CPU, fp16 on CUDA;
            or a ``vistrain.fsdp.Precision`` (compute and reduce dtypes); the shards stay fp32.
            Independent of the Trainer's ``precision`` (autocast), which alone keeps results
            equal to DDP's.
        step_in_backward: the optimizer steps each shard as soon as its gradient is final and
            frees it (one optimizer, automatic optimization, no gradient clipping or fp16
            scaling: where the result equals the ordinary step).
        gather_public_methods: a unit's public methods (``self.backbone.encode(...)``,
            ``forward_features``...) gather its weights as its forward does, as under DDP
            nothing needs registering; False: only ``forward`` and methods registered with
            ``vistrain.fsdp.register_forward_method`` gather (``docs/engine.md``).
        start_method, process_group_backend, timeout, accelerator, parallel_devices,
        cluster_environment, precision_plugin: as ``DDPStrategy``.
        unit_options: further options of every unit (``flatten_parameters``, ``move_params_to_cpu``,
            ``groups``...) and ``root=vistrain.fsdp.RootOptions(prefetch_depth=..., collective_timeout=...)``
            for the whole model (see ``vistrain.fsdp.FullyShardedDataParallel``).
    """

    strategy_name = "vistrain_fsdp"

    def __init__(
        self,
        auto_wrap_policy=None,
        reshard_after_forward: bool = True,
        mixed_precision=False,
        step_in_backward: bool = False,
        gather_public_methods: bool = True,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        **unit_options,
    ):
        unknown = sorted(set(unit_options) - set(unit_option_names()))
        if unknown:
            raise StrategyError(
                f"VistrainFSDPStrategy got an unknown engine option {unknown[0]!r}; the options are "
                f"{', '.join(unit_option_names())}"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.auto_wrap_policy = auto_wrap_policy
        self.step_in_backward = step_in_backward
        self.mixed_precision = mixed_precision
        self.unit_options = dict(
            unit_options,
            reshard_after_forward=reshard_after_forward,
            gather_public_methods=gather_public_methods,
        )
        self._interrupted = False  # an exception ended the stage: teardown gathers nothing

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``"vistrain_fsdp"`` (processes started as scripts, as ``"ddp"``), and
        ``"vistrain_fsdp_spawn"`` / ``"vistrain_fsdp_fork"`` (as ``"ddp_spawn"`` / ``"ddp_fork"``)."""
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            name = cls.strategy_name + suffix
            if name not in strategy_registry:
                description = f"vistrain's fully sharded data parallel engine, start_method '{start_method}'"
                strategy_registry.register(name, cls, description=description, start_method=start_method)

    # -- precision: clipping and fp16 scaling on shards -----------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ShardedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else sharded_precision(plugin)

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self._interrupted = False
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._layer_sync = with_sharded_sync(self._layer_sync)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting and self._layer_sync:  # on its device: CUDA and CPU take different sync BNs
            self.model = self._layer_sync.apply(self.model)
        _own_storage(self.model)
        if fitting:
            self.setup_optimizers(trainer)  # the user's configure_optimizers, on the plain module
            self._check_fit_options(trainer)
        else:
            self._reset_optimizers_and_schedulers()  # a previous fit's optimizers hold old shards
        self.model = self._setup_model(self.model)
        self.setup_precision_plugin()
        if fitting and self.step_in_backward:
            bind_step_in_backward(self.model, self.optimizers[0])

    def _setup_model(self, model):
        """Wrap ``model`` (the LightningModule) and point the optimizers' param groups at the
        local parameters."""
        places = parameter_places(model)
        root = wrap(
            model,
            build_policy(self.auto_wrap_policy, model),
            dict(self.unit_options, precision=unit_precision(self.mixed_precision, self.root_device)),
        )
        point_optimizers_at_shards(root, self.optimizers, places)
        owned = root_owned_names(root)
        if owned and not self.lightning_module.automatic_optimization:
            raise StrategyError(
                f"manual optimization under vistrain_fsdp: parameters {owned[:3]} belong to no "
                "nested unit; move them into a submodule the auto_wrap_policy wraps (a LightningModule's "
                "own parameters can only be used in automatic optimization)"
            )
        return root

    def _check_fit_options(self, trainer) -> None:
        if not self.step_in_backward:
            return
        scaled = (
            isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None
        )
        reasons = {
            "manual optimization": not self.lightning_module.automatic_optimization,
            "gradient_clip_val": bool(trainer.gradient_clip_val),
            "16-mixed loss scaling": scaled,
            f"{len(self.optimizers)} optimizers": len(self.optimizers) != 1,
        }
        found = [reason for reason, present in reasons.items() if present]
        if found:
            raise StrategyError(
                f"step_in_backward=True cannot be exact with {found[0]} (the step needs every "
                "gradient first); set step_in_backward=False"
            )

    # -- steps ------------------------------------------------------------------------------------
    def training_step(self, *args, **kwargs):
        if self.lightning_module.automatic_optimization or not is_wrapped(self.model):
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            open_step(self.model, self.lightning_module)
            return self.lightning_module.training_step(*args, **kwargs)

    def on_validation_start(self) -> None:
        self._evaluate_on_rank0_buffers()

    def on_test_start(self) -> None:
        self._evaluate_on_rank0_buffers()

    def on_predict_start(self) -> None:
        self._evaluate_on_rank0_buffers()

    def _evaluate_on_rank0_buffers(self) -> None:
        # without SyncBatchNorm, each rank's running statistics differ; DDP evaluates on rank 0's
        if is_wrapped(self.model):
            broadcast_buffers(self.model)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: no reduction until the last micro-batch."""
        with no_sync(self.model) if is_wrapped(self.model) else contextlib.nullcontext():
            yield

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards exist only once the model is wrapped

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return {}  # the weights are written by every rank in save_checkpoint, never gathered

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        return {}  # likewise

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options=None) -> None:
        """Write the folder ``filepath`` (vistrain's sharded format); collective."""
        if storage_options is not None:
            raise TypeError("VistrainFSDPStrategy.save_checkpoint takes no storage_options")
        ckpt.save(self.broadcast(str(filepath)), self.model, self.optimizers, checkpoint, self._progress())

    def _progress(self) -> Dict[str, int]:
        """Batches done in the current epoch and batches per epoch, where the Trainer knows them."""
        try:
            trainer = self.lightning_module.trainer
        except (AttributeError, RuntimeError):  # no module, or one not attached to a Trainer
            return {}
        if not isinstance(trainer.num_training_batches, int):
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        return {"iteration_in_epoch": done, "iters_per_epoch": trainer.num_training_batches}

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        if not ckpt.is_sharded_checkpoint(path):
            raise StrategyError(
                f"{path} is not a vistrain checkpoint folder (no metadata.json); vistrain_fsdp loads "
                "the folders its trainer.save_checkpoint / ModelCheckpoint write"
            )
        return ckpt.read(path)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        ckpt.load_model(checkpoint, self.model)  # always strict: every key and shape must match

    def load_optimizer_state_dict(self, checkpoint) -> None:
        ckpt.load_optimizers(checkpoint, self.model, self.optimizers)

    # -- teardown ---------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Gather the trained model and its optimizer state back into the plain LightningModule
        and its optimizers, on every rank and in host memory, as DDP leaves them (a checkpoint
        saved afterwards holds both); after an exception the model stays sharded (no collective
        with dead peers)."""
        if is_wrapped(self.model) and not self._interrupted:
            unwrap(self.model, self.optimizers)
            self.model = self.lightning_module
        super().teardown()


def _own_storage(module) -> None:
    """Give this rank its own copy of every CPU parameter and buffer still in shared memory.
    Ranks Lightning starts with ``forkserver`` receive the module pickled through shared memory
    (it copies only under ``spawn``): every rank would then step and update one set of weights
    and BatchNorm statistics. The tensors keep their identity (optimizers hold them)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type == "cpu" and tensor.is_shared():
            tensor.data = tensor.data.clone()
