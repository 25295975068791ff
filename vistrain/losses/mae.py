"""MAE's reconstruction loss (He et al., 2022): "the mean squared error between the reconstructed
and original images in the pixel space ... computed only on masked patches".

With ``norm_pix_loss`` the target of each patch is its pixels normalised by the patch's own mean
and variance (``(t - mean) / sqrt(var + 1e-6)``, the unbiased variance over the patch's P*P*C
values, as MAE's ``forward_loss``), which the paper finds improves representations.

Every rank masks the same number of patches per image, so the mean over this rank's masked
patches, averaged over ranks by DDP or the sharded engine, is the mean over the global batch.
"""

import torch


def mae_loss(
    predicted: torch.Tensor, target: torch.Tensor, masked: torch.Tensor, norm_pix_loss: bool
) -> torch.Tensor:
    """Mean over masked patches of the per-patch mean squared error.

    Args:
        predicted: (N, L, P*P*C) the decoder's pixels for every patch.
        target: (N, L, P*P*C) the image's patches (``models.masking.patchify``).
        masked: (N, M) indices of each image's masked patches.
        norm_pix_loss: normalise each target patch by its own mean and variance first.

    Returns the scalar ``sum_{n, l in masked_n} |pred_nl - t_nl|^2 / (P*P*C) / (N M)`` in fp32.
    """
    predicted, target = predicted.float(), target.float()
    if norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    pick = masked.unsqueeze(-1).expand(-1, -1, target.shape[-1])
    return (predicted.gather(1, pick) - target.gather(1, pick)).pow(2).mean()
