"""Smoke runs of every shipped training recipe (shrunk to a few iterations), on 2 gloo ranks."""

import json
from pathlib import Path

import pytest
import torch

from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config
from vistrain.training.trainer import train

TRAINING_RECIPES = [
    "regnet_fsdp",
    "pretrain/simclr_regnet_demo",
    "pretrain/swav_regnet_demo",
    "pretrain/dino_regnet_demo",
    "pretrain/dino_vit_demo",
    "pretrain/dinov2_vit_demo",
    "pretrain/byol_regnet_demo",
    "pretrain/simclr_timm_demo",
]
# recipes with a momentum teacher: sharded (student and teacher) and DDP give the same losses
TEACHER_RECIPES = [
    "pretrain/dino_regnet_demo",
    "pretrain/dino_vit_demo",
    "pretrain/dinov2_vit_demo",
    "pretrain/byol_regnet_demo",
]


def shrunk(name, run_dir, cache_dir, *overrides):
    return [
        f"config={name}",
        f"config.CHECKPOINT.DIR={run_dir}",
        f"config.DATA.CACHE_DIR={cache_dir}",
        "config.DATA.TRAIN.DATA_LIMIT=48",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
        "config.OPTIMIZER.num_epochs=1",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0.5",  # the ViT demo warms up 5 of 40
        "config.LOG_FREQUENCY=1",
        "config.DATA.NUM_DATALOADER_WORKERS=0",  # no loader processes to start for 3 steps
        "config.MONITOR.EVERY_EPOCHS=0",  # the demos' monitor: one smoke test below
        *overrides,
    ]


def _train(rank, world, argv):
    train(load_config(argv))


def losses(run_dir):
    records = map(json.loads, Path(run_dir, "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if "loss" in r]  # the monitor's records carry none


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", TRAINING_RECIPES)
def test_recipe_trains_and_checkpoints(name, tmp_path, cache_dir):
    """3 steps of each recipe; the quick start keeps its shipped monitor: a pass after the epoch."""
    every = load_config([f"config={name}"]).MONITOR.EVERY_EPOCHS
    watch = [f"config.MONITOR.EVERY_EPOCHS={every}"] if name == "regnet_fsdp" else []
    run_on_ranks(_train, 2, shrunk(name, tmp_path, cache_dir, *watch))
    assert len(losses(tmp_path)) == 3  # 48 images / (8 per rank x 2 ranks)
    assert (tmp_path / "config.yaml").exists()
    assert any(p.name.startswith("checkpoint_") for p in tmp_path.iterdir())
    if watch:
        records = [json.loads(line) for line in Path(tmp_path, "metrics.jsonl").read_text().splitlines()]
        (monitor,) = [r for r in records if "rankme" in r]
        # (no kNN here: the first 48 training digits are all zeros, the test digits are not)
        assert every > 0 and monitor["iteration"] == 3 and monitor["epoch"] == 0
        assert monitor["rankme"] > 1 and monitor["feature_std"] > 0 and monitor["monitor_seconds"] > 0


def test_quick_start_sharded_equals_ddp(tmp_path, cache_dir):
    """The quick start under AUTO_SETUP_FSDP and under DDP: the same losses."""
    run_on_ranks(_train, 2, shrunk("regnet_fsdp", tmp_path / "sharded", cache_dir))
    run_on_ranks(
        _train,
        2,
        shrunk("regnet_fsdp", tmp_path / "ddp", cache_dir, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"),
    )
    torch.testing.assert_close(losses(tmp_path / "sharded"), losses(tmp_path / "ddp"), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "variant, compared",
    [
        (["config.OPTIMIZER.update_freq=2"], 3),  # gradient accumulation through no_sync
        # PyTorch's fully_shard, same wrap policy. Its reduce order rounds differently from DDP's
        # (1e-7), and at the second step a ReLU input 1e-6 from zero falls on the other side of
        # the kink on one rank: a 6e-3 change of the trunk's gradient, so the third loss moves
        # 1.4e-4. Two losses (the first update) are the comparison that is not chaotic.
        (["config.MODEL.FSDP_CONFIG.BACKEND=torch"], 2),
        (["config.OPTIMIZER.name=lars", "config.OPTIMIZER.head_lr_multiplier=0.5"], 3),
    ],
)
def test_trainer_variants_sharded_equal_ddp(variant, compared, tmp_path, cache_dir):
    run_on_ranks(_train, 2, shrunk("regnet_fsdp", tmp_path / "sharded", cache_dir, *variant))
    ddp_variant = [v for v in variant if "BACKEND" not in v]
    run_on_ranks(
        _train,
        2,
        shrunk(
            "regnet_fsdp",
            tmp_path / "ddp",
            cache_dir,
            *ddp_variant,
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
        ),
    )
    sharded, ddp = losses(tmp_path / "sharded"), losses(tmp_path / "ddp")
    assert len(sharded) == len(ddp) == 3
    torch.testing.assert_close(sharded[:compared], ddp[:compared], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", TEACHER_RECIPES)
def test_teacher_recipe_sharded_equals_ddp(name, tmp_path, cache_dir):
    """The first 3 losses (fp32, 2 ranks) under AUTO_SETUP_FSDP and under DDP with a plain
    teacher copy: the sharded teacher's forward and its EMA of local shards are exact."""
    sharded = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False"]
    run_on_ranks(_train, 2, shrunk(name, tmp_path / "sharded", cache_dir, *sharded))
    ddp = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"]
    run_on_ranks(_train, 2, shrunk(name, tmp_path / "ddp", cache_dir, *ddp))
    assert len(losses(tmp_path / "sharded")) == 3
    torch.testing.assert_close(losses(tmp_path / "sharded"), losses(tmp_path / "ddp"), rtol=1e-5, atol=0)


def test_mae_elpv_recipe_pretrains_and_its_trunk_finetunes(tmp_path):
    """The MAE ELPV recipe and its evaluation on generated cells (the package's layout), 32 px:
    2 epochs of pretraining on 2 ranks, then the fine-tuning recipe from its checkpoint."""
    from test_finetune import _finetune
    from test_real_images import _elpv_folder

    folder = _elpv_folder(tmp_path / "elpv")
    small = [
        *[f"config.DATA.{s}.DATA_PATHS=[{folder}]" for s in ("TRAIN", "TEST")],
        *[f"config.DATA.{s}.DECODE_SIZE=32" for s in ("TRAIN", "TEST")],
        "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[32]",
        "config.MODEL.TRUNK.VIT.IMAGE_SIZE=32",  # 16 patches of 8 px
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
        "config.DATA.NUM_DATALOADER_WORKERS=0",
        "config.OPTIMIZER.num_epochs=2",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0.5",
        "config.LOG_FREQUENCY=1",
    ]
    pretrain = tmp_path / "pretrain"
    run_on_ranks(_train, 2, ["config=pretrain/mae_vit_elpv", f"config.CHECKPOINT.DIR={pretrain}", *small])
    assert len(losses(pretrain)) > 2 and all(torch.isfinite(torch.tensor(losses(pretrain))))
    run_on_ranks(
        _finetune,
        2,
        [
            "config=benchmark/finetune_vit_elpv", f"config.CHECKPOINT.DIR={tmp_path / 'finetune'}", *small,
            "config.DATA.TEST.TRANSFORMS.RESIZE=32", "config.DATA.TEST.TRANSFORMS.CENTER_CROP=32",
            "config.DATA.TEST.BATCHSIZE_PER_REPLICA=4", "config.OPTIMIZER.num_epochs=1",
            "config.BENCHMARK.FINETUNE.LRS=[0.001]", f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={pretrain}",
        ],
    )  # fmt: skip
    record = json.loads((tmp_path / "finetune" / "metrics.json").read_text())
    assert {"top1", "top1_2class"} <= set(record["picked"])
