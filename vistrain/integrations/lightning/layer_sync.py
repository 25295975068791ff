"""``Trainer(sync_batchnorm=True)`` under ``vistrain_fsdp``: batch statistics over every rank.

Lightning's ``TorchSyncBatchNorm`` converts to ``torch.nn.SyncBatchNorm``, which refuses CPU
tensors (``DDPStrategy`` cannot sync BatchNorm on CPU at all). Here the conversion runs once the
module is on its device and takes vistrain's own synchronised BatchNorm there
(``vistrain.distributed.sync_batchnorm``: torch's on CUDA, an all-reduce based one on CPU), so the
statistics of a step equal those of one process on the global batch on either device. Teardown
turns both kinds back into plain BatchNorm layers, as Lightning's plugin does.
"""

import torch
from pytorch_lightning.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from torch import nn

from vistrain.distributed.sync_batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm


class ShardedSyncBatchNorm(LayerSync):
    """Lightning's layer-sync plugin with vistrain's synchronised BatchNorm (CPU and CUDA)."""

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(model)

    def revert(self, model: nn.Module) -> nn.Module:
        if isinstance(model, CPUSyncBatchNorm):
            model = _as_torch_sync(model)
        return TorchSyncBatchNorm().revert(model)


def _as_torch_sync(bn: CPUSyncBatchNorm) -> nn.SyncBatchNorm:
    """A ``torch.nn.SyncBatchNorm`` sharing ``bn``'s parameters and buffers (for the revert)."""
    out = nn.SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    with torch.no_grad():
        if bn.affine:
            out.weight, out.bias = bn.weight, bn.bias
    out.running_mean, out.running_var = bn.running_mean, bn.running_var
    out.num_batches_tracked = bn.num_batches_tracked
    out.train(bn.training)
    return out


def with_sharded_sync(layer_sync):
    """The plugin to use for ``layer_sync`` (the Trainer's): Lightning's torch SyncBatchNorm is
    replaced by :class:`ShardedSyncBatchNorm`; any other (a user's own) is kept."""
    return ShardedSyncBatchNorm() if type(layer_sync) is TorchSyncBatchNorm else layer_sync
