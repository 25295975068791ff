"""The frozen trunk's BatchNorm statistics, recomputed on the images it is evaluated on.

A trunk carries running statistics that are an exponential average over its last training
batches: augmented crops (of several sizes with multi-crop), taken while the weights still moved.
A random trunk carries its initialisation's (mean 0, variance 1), which standardise nothing.
``BENCHMARK.TRUNK_BN_STATS: recompute`` replaces both by "precise" statistics (Wu & Johnson 2021,
*Rethinking "Batch" in BatchNorm*, sec. 3): with the weights fixed, one pass over DATA.TRAIN's
images (each view of ``BENCHMARK.FEATURE_VIEWS``), and every BatchNorm's running statistics set to
the average over the K batches of the batch statistics,

    mu = 1/K sum_k mean_k,    sigma^2 = 1/K sum_k var_k   (var_k: Bessel-corrected, as torch keeps it)

Pretrained and random trunks go through the same rule, so a random-trunk control stays the same
evaluation path. The batches' statistics are those of the global batch (the BatchNorms are
synchronised over the ranks for the pass), so every rank ends with the same statistics and the
result does not depend on how a global batch is split over ranks.
"""

from typing import Iterable, Optional

import torch
from torch import nn

from vistrain.distributed import comm
from vistrain.distributed.sync_batchnorm import convert_sync_batchnorm
from vistrain.runtime.logger import logger
from vistrain.torch_compat import BatchNormBase

# BENCHMARK.TRUNK_BN_STATS: what the frozen trunk's BatchNorms normalise with
TRUNK_BN_STATS = ("running", "recompute")


def batch_norms(model: nn.Module):
    """The BatchNorms of ``model`` that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]


@torch.no_grad()
def recompute_bn_statistics(
    model: nn.Module, batches: Iterable[torch.Tensor], dtype: Optional[torch.dtype] = None
) -> nn.Module:
    """Set every BatchNorm's running mean and variance of ``model`` to the average over the
    forward passes of the global batch's statistics (module docstring); returns ``model`` (its
    BatchNorms synchronised: in eval mode they are plain BatchNorms), in eval mode.

    ``batches``: images (N_r, C, H, W) on the model's device, one forward pass each (the caller
    gives each view of a batch as a batch of its own); ``dtype``: the autocast of the feature
    extraction. Collective: every rank must give the same number of batches (the
    DistributedSampler pads; a rank's batch may be empty).
    """
    model = convert_sync_batchnorm(model)  # synced copies sharing the buffers
    norms = batch_norms(model)
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # torch's cumulative average: the k-th batch gets weight 1/k
    model.train()
    passes = 0
    try:
        for images in batches:
            with torch.autocast(images.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                model(images)
            passes += 1
    finally:
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
        model.eval()
    if comm.is_main_process():
        logger.info(f"recomputed the statistics of {len(norms)} BatchNorm layers over {passes} passes")
    return model
