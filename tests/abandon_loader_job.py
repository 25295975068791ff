"""A process that leaves its loaders' passes unfinished, then exits (test_preemption.py): a loader
with a persistent worker (``build_loader``, workers ignoring SIGTERM) left after its first batch,
in a ``multiprocessing`` child (as a spawned rank, whose exit runs no ``atexit`` handler) and in
this process, and a views-on-device loader left by an exception raised in its loop.

    python tests/abandon_loader_job.py OUT_FILE

Writes the child's exit code (``child 0``; ``child hung`` if it has not ended within 60 s) and
``left`` to OUT_FILE; exits 1 with the exception's traceback.
"""

import multiprocessing
import sys

from vistrain.data import build_loader, set_epoch
from vistrain.methods import get_defaults

KEPT = []  # the loaders, alive at exit as a trainer's would be


def _loader(views_on_device: bool):
    cfg = get_defaults().DATA
    cfg.NUM_DATALOADER_WORKERS = 1
    split = cfg.TRAIN
    split.DATA_SOURCES, split.SYNTHETIC_SIZE, split.IMAGE_SIZE = ["synthetic"], 64, 12
    split.BATCHSIZE_PER_REPLICA, split.VIEWS_ON_DEVICE = 2, views_on_device
    split.TRANSFORMS.SIZE_CROPS = [8]
    loader = build_loader(cfg, "TRAIN", seed=0, device="cpu", rank=0, world_size=1)
    set_epoch(loader, 0)
    KEPT.append(loader)
    return loader


def _stop_early() -> None:
    for _batch in _loader(views_on_device=False):
        break  # a trainer stopping early


if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=_stop_early)
    child.start()
    child.join(timeout=60)
    with open(sys.argv[1], "w") as out:
        out.write("child hung\n" if child.is_alive() else f"child {child.exitcode}\n")
        if child.is_alive():
            child.kill()
        _stop_early()
        for _batch in _loader(views_on_device=True):
            out.write("left\n")
            raise RuntimeError("abandoned mid-epoch")
