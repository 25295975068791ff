"""Prints the time of one MAE training step against one DINO step on the same ViT and images.

The recipes as shipped (``pretrain/mae_vit_demo``: one crop, a quarter of the patches through the
encoder, a 2-block decoder; ``pretrain/dino_vit_demo``: two crops through the student, the same two
through the momentum teacher without gradients), built plainly in one process on the same batch
of images, then the encoder alone (forward + backward of the trunk on every patch against on the
kept quarter). Each pair is timed interleaved (``--rounds`` rounds, median of each), so a busy
machine slows both alike; the printed ratios are what the comparison claims.

    python dev/bench/bench_mae_step.py [--batch 64] [--rounds 15] [--threads 1] [--image 28]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vistrain.methods import build_method, build_model, load_config  # noqa: E402


def _setup(recipe: str, image: int):
    overrides = [f"config=pretrain/{recipe}", f"config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[{image}]"]
    overrides.append(f"config.MODEL.TRUNK.VIT.IMAGE_SIZE={image}")
    cfg = load_config(overrides)
    torch.manual_seed(0)
    model, criterion = build_model(cfg.MODEL), build_method(cfg)
    teacher = build_model(cfg.MODEL).requires_grad_(False) if criterion.teacher_momentum else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    crops = sum(cfg.DATA.TRAIN.TRANSFORMS.NUM_CROPS)
    return model, criterion, teacher, optimizer, crops


def _step(setup, images):
    model, criterion, teacher, optimizer, crops = setup
    views = [images] * crops
    student = criterion.student_crops(views)
    masking, targets = criterion.masking(student), None
    if teacher is not None:
        with torch.no_grad():
            targets = teacher(criterion.teacher_crops(views), **criterion.teacher_masking())
    loss = criterion(model(student, **masking), len(views), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _encoder(trunk, images, keep):
    out = trunk(images, keep=keep)
    next(iter(out.values())).float().sum().backward()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _pair(first, second, rounds: int):
    for _ in range(2):  # warm-up
        first(), second()
    a, b = [], []
    for _ in range(rounds):
        a.append(_timed(first))
        b.append(_timed(second))
    return statistics.median(a), statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--image", type=int, default=28, help="crop side (patches of 4 px)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    images = torch.randn(args.batch, 3, args.image, args.image)
    mae, dino = _setup("mae_vit_demo", args.image), _setup("dino_vit_demo", args.image)
    t_mae, t_dino = _pair(lambda: _step(mae, images), lambda: _step(dino, images), args.rounds)
    patches = (args.image // 4) ** 2
    keep = torch.stack([torch.randperm(patches)[: patches // 4] for _ in range(args.batch)])
    trunk = mae[0].trunk
    t_quarter, t_all = _pair(
        lambda: _encoder(trunk, images, keep), lambda: _encoder(trunk, images, None), args.rounds
    )
    print(
        f"batch {args.batch} of {args.image} px ({patches} patches), {args.threads} thread(s), {args.rounds} rounds"
    )
    print(
        f"step          MAE {t_mae * 1e3:8.1f} ms   DINO {t_dino * 1e3:8.1f} ms   MAE / DINO {t_mae / t_dino:.2f}"
    )
    print(
        f"encoder f+b   {keep.shape[1]} patches {t_quarter * 1e3:6.1f} ms   all {t_all * 1e3:6.1f} ms   "
        f"ratio {t_quarter / t_all:.2f}"
    )


if __name__ == "__main__":
    main()
