"""Smoke runs of the real-data recipes (RegNetY-400MF SimCLR, SEER-sized SwAV) on 2 gloo ranks.

The recipes run as shipped except for what cannot run in seconds on a CPU: the trunk (shrunk to
two small stages, head widths to match), the crop sizes, the batch and the device. Their data
paths point at tiny synthetic ImageNet-style data written to disk (a train/ + val/ class folder
tree for SimCLR, a "path label" file list for SwAV), so the disk readers the recipes name run too.
Everything else (LARS, sync BatchNorm, AMP, the sharded engine, activation checkpointing, multi-crop,
Sinkhorn settings) is the recipe's own.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.jobs import check_values
from vistrain.methods import load_config
from vistrain.models.trunks.regnet import block_params_from_config
from vistrain.training.trainer import train

RECIPES = {
    "simclr": "pretrain/simclr_regnet_y_400mf_imagenet",
    "swav": "pretrain/swav_regnet_y_256gf_seer",
}
TINY_TRUNK = [
    "config.MODEL.TRUNK.REGNET.NAME=custom",
    "config.MODEL.TRUNK.REGNET.DEPTH=2",
    "config.MODEL.TRUNK.REGNET.W_0=8",
    "config.MODEL.TRUNK.REGNET.W_A=8.0",
    "config.MODEL.TRUNK.REGNET.W_M=2.0",
    "config.MODEL.TRUNK.REGNET.GROUP_WIDTH=8",
    "config.MODEL.TRUNK.REGNET.STEM_WIDTH=8",
]


def _write_images(root: Path, count: int, size: int = 24):
    """``count`` random RGB PNGs in two classes under ``root/<class>/``; returns [(path, label)]."""
    rng = np.random.default_rng(0)
    items = []
    for i in range(count):
        label = i % 2
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path)
        items.append((path, label))
    return items


def _smoke_overrides(run_dir: Path):
    return [
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.MACHINE.DEVICE=cpu",
        "config.DISTRIBUTED.NUM_NODES=1",
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
        "config.DATA.NUM_DATALOADER_WORKERS=0",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
        "config.OPTIMIZER.num_epochs=1",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0.5",
        "config.LOG_FREQUENCY=1",
        *TINY_TRUNK,
    ]


def _train(rank, world, argv):
    train(load_config(argv))


def _losses(run_dir: Path):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_shipped_head_reads_the_named_trunks_width(method):
    cfg = load_config([f"config={RECIPES[method]}"])
    widths = block_params_from_config(cfg.MODEL.TRUNK.REGNET).widths
    assert cfg.MODEL.HEAD.DIMS[0] == widths[-1]


def test_simclr_regnet_y_400mf_recipe_trains_on_an_image_folder(tmp_path):
    _write_images(tmp_path / "imagenet" / "train", 16)
    _write_images(tmp_path / "imagenet" / "val", 4)
    run_dir = tmp_path / "run"
    argv = [
        f"config={RECIPES['simclr']}",
        *_smoke_overrides(run_dir),
        f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'imagenet'}]",
        "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[16]",
        "config.MODEL.HEAD.DIMS=[16,64,16]",
    ]
    run_on_ranks(_train, 2, argv)
    losses = _losses(run_dir)
    assert len(losses) == 2 and all(np.isfinite(losses))  # 16 images / (4 per rank x 2 ranks)
    assert any(p.name.startswith("checkpoint_") for p in run_dir.iterdir())


def test_swav_seer_recipe_trains_sharded_on_a_file_list(tmp_path):
    items = _write_images(tmp_path / "images", 16)
    file_list = tmp_path / "train_images.txt"
    file_list.write_text("".join(f"{path.relative_to(tmp_path)} -1\n" for path, _ in items))
    run_dir = tmp_path / "run"
    argv = [
        f"config={RECIPES['swav']}",
        *_smoke_overrides(run_dir),
        f"config.DATA.TRAIN.DATA_PATHS=[{file_list}]",
        "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[16,8]",
        "config.MODEL.HEAD.DIMS=[16,32,16]",
        "config.MODEL.HEAD.NMB_PROTOTYPES=[12]",
        "config.LOSS.swav_loss.freeze_prototypes_niters=1",
    ]
    cfg = load_config(argv)
    assert (
        cfg.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP
        and cfg.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING
    )
    run_on_ranks(_train, 2, argv)
    losses = _losses(run_dir)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert any(p.name.startswith("checkpoint_") for p in run_dir.iterdir())
    metadata = json.loads(next(run_dir.glob("checkpoint_*/metadata.json")).read_text())
    assert metadata["world_size"] == 2


def test_recipes_pass_the_config_checks_once_their_data_exists(tmp_path):
    # at least one global batch (DROP_LAST): SimCLR 8 ranks x 64 images, SwAV 64 ranks x 16
    items = _write_images(tmp_path / "imagenet" / "train", 512, size=4)
    _write_images(tmp_path / "imagenet" / "val", 2)
    file_list = tmp_path / "train_images.txt"
    file_list.write_text("".join(f"{path} -1\n" for path, _ in items * 2))
    folder = f"[{tmp_path / 'imagenet'}]"
    simclr = [
        f"config={RECIPES['simclr']}",
        f"config.DATA.TRAIN.DATA_PATHS={folder}",
        f"config.DATA.TEST.DATA_PATHS={folder}",
    ]
    check_values(load_config(simclr))
    with pytest.raises(
        ConfigError, match=r"DATA.TRAIN has 511 samples, fewer than one global batch \(8 ranks"
    ):
        check_values(load_config([*simclr, "config.DATA.TRAIN.DATA_LIMIT=511"]))
    check_values(load_config([f"config={RECIPES['swav']}", f"config.DATA.TRAIN.DATA_PATHS=[{file_list}]"]))
