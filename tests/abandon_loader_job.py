"""A process that leaves its loaders' passes unfinished, then exits (test_preemption.py): a loader
with a persistent worker (``build_loader``, workers ignoring SIGTERM) left after its first batch,
and a views-on-device loader left by an exception raised in its loop.

    python tests/abandon_loader_job.py OUT_FILE

Writes ``left`` to OUT_FILE when both passes are abandoned; exits 1 with the exception's traceback.
"""

import sys

from vistrain.data import build_loader, set_epoch
from vistrain.methods import get_defaults


def _loader(views_on_device: bool):
    cfg = get_defaults().DATA
    cfg.NUM_DATALOADER_WORKERS = 1
    split = cfg.TRAIN
    split.DATA_SOURCES, split.SYNTHETIC_SIZE, split.IMAGE_SIZE = ["synthetic"], 64, 12
    split.BATCHSIZE_PER_REPLICA, split.VIEWS_ON_DEVICE = 2, views_on_device
    split.TRANSFORMS.SIZE_CROPS = [8]
    loader = build_loader(cfg, "TRAIN", seed=0, device="cpu", rank=0, world_size=1)
    set_epoch(loader, 0)
    return loader


if __name__ == "__main__":
    kept = [_loader(views_on_device=False), _loader(views_on_device=True)]  # as a trainer holds them
    for _batch in kept[0]:
        break  # a trainer stopping early
    with open(sys.argv[1], "w") as out:
        for _batch in kept[1]:
            out.write("left\n")
            raise RuntimeError("abandoned mid-epoch")
