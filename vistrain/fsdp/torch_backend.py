"""PyTorch's own ``fully_shard`` (FSDP2) behind the interface vistrain's loop uses.

The built-in engine is :class:`~vistrain.fsdp.FullyShardedDataParallel`; this adapter lets the same
recipes run on ``fully_shard`` (``MODEL.FSDP_CONFIG.BACKEND=torch``) as a baseline to measure
against. Its parameters are DTensor shards; names are those of ``self.module``.
"""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)


class TorchShardedModel(nn.Module):
    """A module already sharded by ``fully_shard``, with DDP's/our engine's method names."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return _NoGradientSync(self.module)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0):
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def state_dict(self, *args, **kwargs):
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))

    def load_state_dict(self, state_dict, strict: bool = True):
        return set_model_state_dict(
            self.module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict)
        )


class _NoGradientSync:
    """``no_sync()`` for fully_shard: gradients stay unreduced until the block ends."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)
