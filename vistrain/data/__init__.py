"""Data pipeline: sources, SSL transforms, distributed sampler, multi-crop collator, loader.

Typical use in a trainer::

    loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device)
    for epoch in range(start_epoch, num_epochs):
        set_epoch(loader, epoch, start_iteration if epoch == start_epoch else 0)
        for batch in loader:  # {"crops": [Tensor(B,3,h,w)...], "label": (B,), "index": (B,), "num_skipped": int}
            ...
"""

from vistrain.data.collate import collate_multicrop  # noqa: F401
from vistrain.data.datasets import (  # noqa: F401
    SOURCES,
    CorruptImageError,
    IndexSubset,
    SSLDataset,
    build_dataset,
)
from vistrain.data.demo_digits import ensure_demo_digits  # noqa: F401
from vistrain.data.folders import read_image  # noqa: F401
from vistrain.data.loader import build_loader, set_epoch  # noqa: F401
from vistrain.data.sampler import DistributedSampler, epoch_order, mix_seed, rank_indices  # noqa: F401
from vistrain.data.transforms import TRANSFORMS, build_transform  # noqa: F401
