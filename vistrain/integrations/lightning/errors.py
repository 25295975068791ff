"""The one error of the Lightning bridge for "the user's input is wrong"."""

from vistrain.config.errors import InputError


class StrategyError(InputError):
    """A Trainer / LightningModule setting the sharded strategy cannot run; one line naming the
    setting and the fix."""

    kind = "vistrain_fsdp strategy error"
