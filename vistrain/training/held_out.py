"""The monitor's held-out images (vistrain/training/monitor.py), read from disk once per run.

Every monitor pass reads the same tensors: DATA.TEST and DATA.TRAIN read like DATA.TEST, in order,
nothing dropped, with the views of epoch 0 (a view depends only on the seed, the epoch and the
image's index: vistrain/data/transforms.py). So the first pass reads them through the loader and,
when this rank's share fits in :data:`KEEP_BYTES`, keeps them in host memory: the later passes
decode nothing and start no loader worker, and extract exactly the batches the first one did.
A larger share keeps its loader (its workers persist between passes) and is read again each pass.
"""

from typing import Iterator, List, Optional, Tuple

import torch

from vistrain.benchmarks import common

KEEP_BYTES = 256 * 2**20  # per rank: the digits' 1,797 images of 28 px take 8 MiB over 2 ranks

Batch = Tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]  # images (N_b, 3, H, W), labels (N_b,), indices (N_b,)


class HeldOutImages:
    """One rank's batches of ``loader`` (built by ``build_loader``, one view per image), as
    :func:`vistrain.benchmarks.common.one_view_batches` reads them: iterating yields
    (images on ``device``, labels, indices) per batch, every pass the same."""

    def __init__(self, loader, device: torch.device):
        self.loader: Optional[object] = loader
        self.device = device
        self.dataset = loader.dataset
        self.kept: Optional[List[Batch]] = None  # the batches on the host, once read and small enough

    def __iter__(self) -> Iterator[Batch]:
        if self.kept is not None:
            for images, labels, indices in self.kept:
                yield images.to(self.device, non_blocking=True), labels, indices
            return
        kept: Optional[List[Batch]] = []
        held = 0
        for images, batch in common.one_view_batches(self.loader, self.device):
            yield images, batch["label"], batch["index"]
            held += images.numel() * images.element_size()
            if kept is not None and held <= KEEP_BYTES:
                kept.append((images.to("cpu"), batch["label"], batch["index"]))
            else:
                kept = None
        if kept is not None:  # a whole pass read: later passes need no loader
            self.kept, self.loader = kept, None
