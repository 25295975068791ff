"""Batch multi-crop samples: one tensor per crop position, so each resolution is one forward pass."""

from typing import Dict, List

import torch


def collate_multicrop(samples: List[dict]) -> Dict[str, object]:
    """Stack B sample dicts (see ``SSLDataset``) into a batch.

    Returns:
        ``"crops"``: List[Tensor (B, 3, h_k, w_k) float32], one entry per crop k in config order
        (all NUM_CROPS[0] views of SIZE_CROPS[0] first, ...; eval: a single entry).
        ``"label"``: LongTensor (B,). ``"index"``: LongTensor (B,), the data set index of each image.
        ``"num_skipped"``: int, unreadable images skipped to build this batch (SKIP_CORRUPT);
        the trainer sums it over batches to log how much bad data it met.
    """
    if not samples:
        raise ValueError("collate_multicrop got an empty batch")
    num_crops = len(samples[0]["crops"])
    if any(len(s["crops"]) != num_crops for s in samples):
        raise ValueError(
            f"samples of one batch have different crop counts: {[len(s['crops']) for s in samples]}"
        )
    crops = []
    for k in range(num_crops):
        views = [s["crops"][k] for s in samples]
        if any(v.shape != views[0].shape for v in views):
            raise ValueError(
                f"crop {k} has different shapes in one batch: {sorted({tuple(v.shape) for v in views})}"
            )
        crops.append(torch.stack(views))
    return {
        "crops": crops,
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        "num_skipped": sum(s.get("skipped", 0) for s in samples),
    }
