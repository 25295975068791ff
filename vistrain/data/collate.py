"""Batch samples: the transform makes the views of all the batch's images at once, one tensor per
crop position, so each resolution is one forward pass."""

from typing import Callable, Dict, List

import torch


def collate_multicrop(samples: List[dict], transform: Callable) -> Dict[str, object]:
    """Turn B sample dicts (see ``SSLDataset``) into a batch; ``transform`` (the data set's, see
    ``vistrain.data.transforms``) makes the views from the samples' ``"prepared"`` parts.

    Returns:
        ``"crops"``: List[Tensor (B, 3, h_k, w_k) float32], one entry per crop k in config order
        (all NUM_CROPS[0] views of SIZE_CROPS[0] first, ...; eval: a single entry).
        ``"label"``: LongTensor (B,). ``"index"``: LongTensor (B,), the data set index of each image.
        ``"num_skipped"``: int, unreadable images skipped to build this batch (SKIP_CORRUPT);
        the trainer sums it over batches to log how much bad data it met.
    """
    if not samples:
        raise ValueError("collate_multicrop got an empty batch")
    return {"crops": transform([s["prepared"] for s in samples]), **collate_fields(samples)}


def collate_fields(samples: List[dict]) -> Dict[str, object]:
    """What a batch holds besides its views: ``"label"``, ``"index"``, ``"num_skipped"`` (above)."""
    return {
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        "num_skipped": sum(s.get("skipped", 0) for s in samples),
    }
