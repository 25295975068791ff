"""Labels of a training batch, for whatever learns from them in the training step (a supervised
method): one reading of ``batch["label"]``, -1 meaning "no label"."""

import torch

NO_LABEL = -1  # an image without a label (an unlabelled file-list line, a flat folder)


def crop_labels(batch: dict, num_crops: int, device: torch.device) -> torch.Tensor:
    """The labels of ``torch.cat(batch["crops"][:num_crops])``: int64 (num_crops * B,) on ``device``,
    ``batch["label"]`` (B,) repeated once per crop (crops are stacked crop by crop: row
    k * B + i is crop k of image i); :data:`NO_LABEL` where the image has none."""
    labels = batch["label"].to(device=device, dtype=torch.long, non_blocking=True)
    return labels.repeat(num_crops)
