"""Lightning's precision plugins, made right for shards.

Lightning clips gradients and scales fp16 losses in the precision plugin. On shards its defaults
are wrong: ``torch.nn.utils.clip_grad_norm_`` would clip each rank's shards by their own norm,
and a plain ``GradScaler`` would let one rank skip a step (an overflow in its shards) that the
others take. Each plugin here is Lightning's own with two changes: ``gradient_clip_val`` clips
by the global norm over every rank's shards, and ``"16-mixed"`` scales with the engine's sharded
scaler on the run's device (its inf/NaN check is max-reduced over the ranks). The strategy
converts the plugin the Trainer picks (:func:`sharded_precision`).
"""

from pytorch_lightning.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from vistrain.integrations.lightning.engine import clip_global_grad_norm_, is_sharded_scaler, sharded_scaler
from vistrain.integrations.lightning.errors import StrategyError


class _GlobalNormClipping:
    """``gradient_clip_algorithm="norm"`` through the engine: the unsharded model's global norm."""

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        clip_global_grad_norm_(list(self.main_params(optimizer)), float(clip_val))


class ShardedPrecision(_GlobalNormClipping, Precision):
    """``precision="32-true"`` on shards."""


class ShardedDoublePrecision(_GlobalNormClipping, DoublePrecision):
    """``precision="64-true"`` on shards."""


class ShardedHalfPrecision(_GlobalNormClipping, HalfPrecision):
    """``precision="16-true"`` / ``"bf16-true"`` on shards (the shards themselves are half)."""


class ShardedMixedPrecision(_GlobalNormClipping, MixedPrecision):
    """``precision="bf16-mixed"`` / ``"16-mixed"`` on shards: autocast as Lightning does; for
    fp16 the engine's sharded scaler on ``device`` ("cpu" or "cuda")."""

    def __init__(self, precision: str, device: str, scaler=None):
        if precision == "16-mixed" and not is_sharded_scaler(scaler):
            scaler = sharded_scaler(device, like=scaler)
        super().__init__(precision, device, scaler)


def sharded_precision(plugin: Precision) -> Precision:
    """The sharded counterpart of the precision plugin the Trainer chose."""
    if isinstance(plugin, _GlobalNormClipping):
        return plugin
    if type(plugin) is Precision:
        return ShardedPrecision()
    if type(plugin) is MixedPrecision:
        return ShardedMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    if type(plugin) is DoublePrecision:
        return ShardedDoublePrecision()
    if type(plugin) is HalfPrecision:
        return ShardedHalfPrecision(plugin.precision)
    raise StrategyError(
        f"precision plugin {type(plugin).__name__} is not supported by vistrain_fsdp; use "
        'precision="32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true" or "16-true"'
    )
