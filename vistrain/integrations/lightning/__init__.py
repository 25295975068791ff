"""PyTorch Lightning on vistrain's sharded engine: ``Trainer(strategy="vistrain_fsdp")``.

    import vistrain.integrations.lightning  # registers "vistrain_fsdp" with Lightning
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="vistrain_fsdp")
    # or, with options:
    from vistrain.integrations.lightning import VistrainFSDPStrategy
    trainer = pl.Trainer(strategy=VistrainFSDPStrategy(auto_wrap_policy=[ResBottleneckBlock]))

Needs ``pip install "vistrain[lightning]"`` (``pytorch_lightning``). The strategy is in
``strategy.py``, the precision plugins it substitutes in ``precision.py``, its checkpoints in
``checkpoint.py``; every engine call in ``engine.py``.
"""

from pytorch_lightning.strategies import StrategyRegistry

from vistrain.integrations.lightning.errors import StrategyError
from vistrain.integrations.lightning.strategy import VistrainFSDPStrategy

VistrainFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["StrategyError", "VistrainFSDPStrategy"]
