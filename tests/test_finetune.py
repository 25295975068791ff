"""Fine-tuning (JOB finetune): sharded against DDP on 2 gloo ranks, the layer-wise lr decay groups,
the ViT's drop path, the held-out choice of lr and epochs, the student or teacher trunk, and a
smoke run of every shipped fine-tuning recipe (shrunk to a few steps)."""

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_real_images import _elpv_folder
from torch import nn
from torchvision.models.vision_transformer import Encoder, EncoderBlock

from vistrain.benchmarks import finetune
from vistrain.benchmarks.finetune import best_run, grid_edge
from vistrain.benchmarks.finetune_model import (
    Classifier,
    build_run_model,
    check_feature_trains_the_trunk,
    classifier_config,
)
from vistrain.checkpoint import CheckpointError
from vistrain.config import ConfigError
from vistrain.data.elpv import ElpvSource
from vistrain.distributed.testing import run_on_ranks
from vistrain.jobs import check_values
from vistrain.methods import build_model, load_config
from vistrain.models.trunks import build_trunk
from vistrain.models.trunks.vit import LayerNorm32, ViTBlock, ViTEncoder, drop_path
from vistrain.optim import build_optimizer
from vistrain.optim.param_groups import build_param_groups

VIT = [
    "config.MODEL.TRUNK.NAME=vit",
    "config.MODEL.TRUNK.VIT.NAME=custom",
    "config.MODEL.TRUNK.VIT.DEPTH=2",
    "config.MODEL.TRUNK.VIT.WIDTH=16",
    "config.MODEL.TRUNK.VIT.HEADS=2",
    "config.MODEL.TRUNK.VIT.PATCH_SIZE=4",
    "config.MODEL.TRUNK.VIT.IMAGE_SIZE=16",
    "config.MODEL.HEAD.DIMS=[16,32,16]",
    "config.BENCHMARK.FINETUNE.FEATURE=cls",
]


def _tiny(run_dir, *overrides):
    return [
        "config=test/finetune_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.LOG_FREQUENCY=1",
        *overrides,
    ]


def _finetune(rank, world_size, argv):
    finetune(load_config(argv))
    return rank


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def _save_pretrained(path, *overrides, teacher_shift=None):
    """A pretraining checkpoint of the tiny recipe (trunk + SSL head), non-trivial BN buffers; with
    ``teacher_shift`` also a teacher under "teacher.": the student's tensors plus that number."""
    cfg = load_config(["config=test/simclr_tiny", *overrides])
    torch.manual_seed(1)
    state = build_model(cfg.MODEL).state_dict()
    for key, value in state.items():
        if key.endswith(("running_mean", "running_var")):
            value.copy_(torch.rand_like(value) + 0.5)
    if teacher_shift is not None:
        teacher = {
            f"teacher.{k}": v + teacher_shift if v.is_floating_point() else v for k, v in state.items()
        }
        state.update(teacher)
    torch.save(state, path)
    return state


# --------------------------------------------------------------------------------------------
# sharded against DDP


@pytest.mark.parametrize(
    "variant",
    [
        [],  # the RegNet recipe shape: SGD, sync BatchNorm, label smoothing, warm-up
        [*VIT, "config.OPTIMIZER.name=adamw", "config.OPTIMIZER.layer_decay=0.75"],
    ],
    ids=["regnet", "vit-layer-decay"],
)
def test_finetune_sharded_equals_ddp(variant, tmp_path):
    """The first 4 losses (fp32, 2 gloo ranks) of a pretrained trunk's fine-tuning under
    AUTO_SETUP_FSDP and under DDP, and the test top-1 after them."""
    pretrained = tmp_path / "pretrained.pt"
    _save_pretrained(pretrained, *[v for v in variant if "TRUNK" in v or "HEAD" in v])
    weights = [
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={pretrained}",
        "config.MODEL.WEIGHTS_INIT.SKIP_LAYERS=[head.]",
    ]
    for name, sharded in (("sharded", True), ("ddp", False)):
        argv = _tiny(
            tmp_path / name, *weights, *variant, f"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP={sharded}"
        )
        run_on_ranks(_finetune, 2, argv)
    assert len(_losses(tmp_path / "sharded")) == 4
    torch.testing.assert_close(_losses(tmp_path / "sharded"), _losses(tmp_path / "ddp"), rtol=1e-5, atol=0)
    records = [json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("sharded", "ddp")]
    assert records[0]["results"] == records[1]["results"]
    assert records[0]["engine"] == "finetune" and records[0]["world_size"] == 2
    assert (tmp_path / "sharded" / "confusion.png").stat().st_size > 0
    assert list((tmp_path / "sharded").glob("checkpoint_4/metadata.json"))  # the fine-tuned weights


def test_vit_drop_path_sharded_equals_ddp(tmp_path):
    """Stochastic depth draws its per-sample masks from the rank's generator: the same draws,
    the same losses, sharded or not; and they differ from a run without drop path."""
    variant = [*VIT, "config.MODEL.TRUNK.VIT.DROP_PATH_RATE=0.5"]
    for name, sharded in (("sharded", True), ("ddp", False)):
        argv = _tiny(tmp_path / name, *variant, f"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP={sharded}")
        run_on_ranks(_finetune, 2, argv)
    run_on_ranks(_finetune, 2, _tiny(tmp_path / "plain", *VIT))
    torch.testing.assert_close(_losses(tmp_path / "sharded"), _losses(tmp_path / "ddp"), rtol=1e-5, atol=0)
    assert _losses(tmp_path / "sharded")[0] != _losses(tmp_path / "plain")[0]


# --------------------------------------------------------------------------------------------
# layer-wise lr decay, drop path


def _classifier(*overrides):
    cfg = load_config(_tiny("unused", *overrides))
    trunk = build_trunk(classifier_config(cfg).TRUNK)
    return cfg, Classifier(trunk, cfg.BENCHMARK.FINETUNE.FEATURE, 2, 10)


def _multipliers(cfg, model, decay):
    opt_cfg = cfg.OPTIMIZER.clone()
    opt_cfg.defrost()
    opt_cfg.layer_decay = decay
    groups = build_param_groups(opt_cfg, model, model.lr_layer)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr_multiplier"], g["name"]) for g in groups for p in g["params"]}


def test_vit_layer_decay_groups_follow_the_blocks():
    """ViT depth 2, decay 0.5: patch embedding, class token, position embeddings x 0.5^3; block 0
    x 0.5^2; block 1 x 0.5; the final LayerNorm and the head x 1; decay and no-decay kept apart."""
    cfg, model = _classifier(*VIT)
    found = _multipliers(cfg, model, 0.5)
    assert len(found) == len(list(model.parameters()))
    for name, (multiplier, group) in found.items():
        if name.startswith(("trunk.conv_proj", "trunk.class_token", "trunk.encoder.pos_embedding")):
            expected = 0.125
        elif name.startswith("trunk.encoder.layers.encoder_layer_"):
            expected = 0.5 ** (2 - int(name.split(".")[3][-1]))
        else:
            assert name.startswith(("trunk.encoder.ln.", "head."))
            expected = 1.0
        assert multiplier == expected, name
        assert group.endswith(f"layer{round(3 + torch.log2(torch.tensor(expected)).item())}")
    assert found["trunk.encoder.ln.weight"][1] == "no_decay_layer3"  # a norm: regularize_bn False
    assert found["head.weight"][1] == "decay_layer3"
    assert set(_multipliers(cfg, model, 1.0).values()) == {(1.0, "decay"), (1.0, "no_decay")}  # off
    optimizer = build_optimizer(cfg.OPTIMIZER, model, model.lr_layer)  # layer_decay 1 (the default)
    assert len(optimizer.param_groups) == 2


def test_regnet_layer_decay_groups_follow_the_stages():
    """RegNet of 2 stages, decay 0.5: the stem x 0.5^3, stage k x 0.5^(3 - k), the head x 1."""
    cfg, model = _classifier()
    found = _multipliers(cfg, model, 0.5)
    for name, (multiplier, _) in found.items():
        stage = re.match(r"trunk\.trunk_output\.block(\d)\.", name)
        layer = int(stage.group(1)) if stage else 3 if name.startswith("head.") else 0
        assert name.startswith(("trunk.stem.", "trunk.trunk_output.", "head.")), name
        assert multiplier == 0.5 ** (3 - layer), name


def test_layer_decay_needs_a_model_with_layers_and_the_finetune_job():
    cfg, model = _classifier()
    opt_cfg = cfg.OPTIMIZER.clone()
    opt_cfg.defrost()
    opt_cfg.layer_decay = 0.5
    with pytest.raises(ValueError, match="layer_decay needs a model that names its layers"):
        build_optimizer(opt_cfg, model)
    for job in ("train", "linear_eval"):
        with pytest.raises(ConfigError, match=f"OPTIMIZER.layer_decay is for JOB finetune; JOB {job}"):
            check_values(
                load_config(_tiny("unused", f"config.JOB={job}", "config.OPTIMIZER.layer_decay=0.5"))
            )


def test_vit_blocks_are_torchvisions_at_drop_path_zero():
    """ViTEncoder draws what torchvision's Encoder draws (same seed, same state dict) and its blocks
    compute what EncoderBlock computes, bit for bit, at rate 0 and in eval mode at any rate."""
    norm = LayerNorm32
    torch.manual_seed(0)
    ours = ViTEncoder(17, 3, 2, 16, 64, norm, drop_path_rate=0.3)
    torch.manual_seed(0)
    theirs = Encoder(17, 3, 2, 16, 64, 0.0, 0.0, norm)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    assert [b.drop_path_rate for b in ours.layers] == [0.0, 0.15, 0.3]
    x = torch.randn(4, 17, 16)
    block, reference = ours.layers[2].eval(), theirs.layers[2].eval()
    assert isinstance(block, EncoderBlock) and isinstance(block, ViTBlock)
    assert torch.equal(block(x), reference(x))
    block.train()
    block.drop_path_rate = 0.0
    assert torch.equal(block(x), reference.train()(x))


def test_drop_path_zeroes_whole_samples_and_keeps_the_mean():
    x = torch.ones(4000, 3, 5)
    torch.manual_seed(0)
    out = drop_path(x, 0.25, training=True)
    per_sample = out.flatten(1)
    assert per_sample.unique().tolist() == [0.0, torch.tensor(1 / 0.75).item()]
    assert torch.all(per_sample.min(1).values == per_sample.max(1).values)  # a sample is dropped whole
    assert abs(out.mean().item() - 1.0) < 0.05
    assert drop_path(x, 0.25, training=False) is x and drop_path(x, 0.0, training=True) is x


# --------------------------------------------------------------------------------------------
# choices, weights, refusals


def test_best_run_takes_the_highest_held_out_score_ties_to_smaller_lr_and_fewer_epochs():
    assert best_run({0.1: [50.0, 70.0, 60.0], 0.3: [40.0, 65.0, 70.0]}) == (0.1, 2)
    assert best_run({0.1: [50.0, 60.0], 0.01: [60.0, 55.0]}) == (0.01, 1)
    assert best_run({0.1: [60.0, 60.0, 60.0]}) == (0.1, 1)


def test_a_choice_at_the_end_of_the_lr_grid_is_named():
    assert grid_edge(0.03, [0.03, 0.1]) == "smallest"
    assert grid_edge(0.1, [0.03, 0.1]) == "largest"
    assert grid_edge(0.1, [0.03, 0.1, 0.3]) == ""
    assert grid_edge(0.1, [0.1]) == ""


def test_held_out_choice_trains_the_final_run_to_the_best_epoch(tmp_path):
    argv = _tiny(
        tmp_path,
        "config.DATA.TRAIN.SYNTHETIC_SIZE=48",
        "config.BENCHMARK.FINETUNE.LRS=[0.01,0.2]",
        "config.OPTIMIZER.num_epochs=3",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
    )
    run_on_ranks(_finetune, 2, argv)
    record = json.loads((tmp_path / "metrics.json").read_text())
    selection = record["selection"]
    scores = {float(lr): s for lr, s in selection["holdout_top1"].items()}
    assert sorted(scores) == [0.01, 0.2] and all(len(s) == 3 for s in scores.values())
    lr, epochs = best_run(scores)
    assert selection["best"] == {"lr": lr, "epochs": epochs, "holdout_top1": scores[lr][epochs - 1]}
    assert (record["lr"], record["epochs"]) == (lr, epochs)
    assert selection["holdout_images"] == 10  # 20% of each class of 4-5, rounded
    # two runs of 3 epochs on 38 images (4 steps of 8), then `epochs` epochs on 48 (6 steps)
    assert record["iterations"] == 2 * 3 * 4 + 6 * epochs
    assert record["results"]["avgpool"]["holdout_top1"] == scores[lr][epochs - 1]
    edge = "smallest" if lr == 0.01 else "largest"
    assert f"lr {lr:g} is the {edge} of BENCHMARK.FINETUNE.LRS" in (tmp_path / "log.txt").read_text()
    # stopped after the first lr's run: the rerun reads its scores and trains the second again
    saved = json.loads((tmp_path / "finetune_selection.json").read_text())
    saved["holdout_top1"] = {"0.01": [-1.0, -1.0, 200.0]}  # marked: only a read gives 200
    (tmp_path / "finetune_selection.json").write_text(json.dumps(saved))
    run_on_ranks(_finetune, 2, argv)
    rerun = json.loads((tmp_path / "metrics.json").read_text())
    assert rerun["selection"]["holdout_top1"] == {"0.01": [-1.0, -1.0, 200.0], "0.2": scores[0.2]}
    assert (rerun["lr"], rerun["epochs"], rerun["iterations"]) == (0.01, 3, 2 * 3 * 4 + 6 * 3)
    assert "lr 0.01: the held-out scores of an earlier run" in (tmp_path / "log.txt").read_text()
    # a damaged file is read as none: every lr trains again
    (tmp_path / "finetune_selection.json").write_text('{"config": ')
    run_on_ranks(_finetune, 2, argv)
    assert json.loads((tmp_path / "metrics.json").read_text())["selection"]["holdout_top1"] == {
        f"{lr:g}": s for lr, s in scores.items()
    }
    # another job in the folder (another epoch count) trains every lr
    run_on_ranks(_finetune, 2, [*argv, "config.OPTIMIZER.num_epochs=2"])
    other = json.loads((tmp_path / "metrics.json").read_text())["selection"]["holdout_top1"]
    assert all(len(s) == 2 and 200.0 not in s for s in other.values())


def test_finetuning_reads_the_student_or_the_teacher(tmp_path):
    state = _save_pretrained(tmp_path / "both.pt", teacher_shift=1.0)
    weights = [
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'both.pt'}",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
    ]
    key = "trunk.stem.0.weight"
    student = build_run_model(load_config(_tiny("unused", *weights)), 10)
    assert torch.equal(student.state_dict()[key], state[key])
    teacher = build_run_model(
        load_config(_tiny("unused", *weights, "config.BENCHMARK.WEIGHTS_FROM=teacher")), 10
    )
    assert torch.equal(teacher.state_dict()[key], state[key] + 1.0)
    _save_pretrained(tmp_path / "student.pt")
    only = [
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'student.pt'}",
        "config.BENCHMARK.WEIGHTS_FROM=teacher",
    ]
    with pytest.raises(CheckpointError, match="holds no key starting with 'teacher.'"):
        build_run_model(
            load_config(_tiny("unused", *only, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False")), 10
        )


def test_a_feature_that_leaves_the_trunk_untrained_is_refused():
    check_feature_trains_the_trunk(load_config(_tiny("unused")))  # avgpool: every parameter
    with pytest.raises(ConfigError, match=r"FEATURE 's1' leaves .* untrained \(trunk.trunk_output.block2"):
        check_feature_trains_the_trunk(load_config(_tiny("unused", "config.BENCHMARK.FINETUNE.FEATURE=s1")))
    with pytest.raises(ConfigError, match="BENCHMARK.FINETUNE.FEATURE must be one of"):
        check_values(load_config(_tiny("unused", "config.BENCHMARK.FINETUNE.FEATURE=s9")))
    with pytest.raises(ConfigError, match=r"fine-tuning uses one view per image.*NUM_CROPS=\[1\]"):
        check_values(load_config(_tiny("unused", "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2]")))


def test_a_map_feature_is_pooled_before_the_head():
    _, model = _classifier("config.BENCHMARK.FINETUNE.FEATURE=s2@2")
    assert model.head.in_features == 16 * 4
    images = torch.randn(3, 3, 16, 16)
    feature = nn.functional.adaptive_avg_pool2d(model.trunk(images)["s2"], 2).flatten(1)
    torch.testing.assert_close(model(images), model.head(feature))


# --------------------------------------------------------------------------------------------
# the shipped recipes, shrunk


def _shrunk(name, run_dir, cache_dir, *overrides):
    return [
        f"config=benchmark/{name}",
        f"config.CHECKPOINT.DIR={run_dir}",
        f"config.DATA.CACHE_DIR={cache_dir}",
        "config.DATA.TRAIN.DATA_LIMIT=64",
        "config.DATA.TEST.DATA_LIMIT=24",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
        "config.DATA.TEST.BATCHSIZE_PER_REPLICA=8",
        "config.DATA.NUM_DATALOADER_WORKERS=0",
        "config.OPTIMIZER.num_epochs=2",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0.5",
        "config.BENCHMARK.FINETUNE.LRS=[0.01,0.1]",
        "config.BENCHMARK.FINETUNE.HOLDOUT_FRACTION=0.25",
        "config.DATA.TRAIN.LABEL_FRACTION=0.5",
        *overrides,
    ]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # the digits written once


@pytest.mark.parametrize("name", ["finetune_regnet", "finetune_vit"])
def test_digit_recipes_finetune(name, tmp_path, cache_dir):
    run_on_ranks(_finetune, 2, _shrunk(name, tmp_path, cache_dir))
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["engine"] == "finetune" and record["label_fraction"] == 0.5
    assert record["results"][record["picked"]["feature"]]["num_images"] == 24
    assert record["selection"]["lrs"] == [0.01, 0.1]


def test_elpv_recipe_finetunes_and_averages_the_symmetries(tmp_path):
    folder = _elpv_folder(tmp_path / "elpv")
    small = [
        *[f"config.DATA.{s}.DATA_PATHS=[{folder}]" for s in ("TRAIN", "TEST")],
        *[f"config.DATA.{s}.DECODE_SIZE=32" for s in ("TRAIN", "TEST")],
        "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[32]",
        "config.DATA.TEST.TRANSFORMS.RESIZE=32",
        "config.DATA.TEST.TRANSFORMS.CENTER_CROP=32",
    ]
    run_dir = tmp_path / "run"
    run_on_ranks(
        _finetune,
        2,
        _shrunk(
            "finetune_elpv", run_dir, tmp_path / "cache", *small, "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4"
        ),
    )
    record = json.loads((run_dir / "metrics.json").read_text())
    assert {"top1", "top1_2class", "holdout_top1"} <= set(record["picked"])
    train = ElpvSource(str(folder), "train", split_seed=0)
    half = sum(max(1, math.floor(n / 2 + 0.5)) for n in Counter(train.labels).values())
    assert record["picked"]["num_images"] == 13 and record["num_train_images"] == half
    cfg = load_config(["config=benchmark/finetune_elpv"])
    assert cfg.BENCHMARK.FEATURE_VIEWS == "dihedral"
