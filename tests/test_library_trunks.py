"""timm and torchvision models as trunks: features, blocks found from the structure, per-unit
initialisation, BatchNorm subclasses under sync BN, one-line errors; on 2 gloo ranks each method
family trains sharded with the first losses of DDP (fp32, 1e-5) and resumes on 3 ranks, and the
other joint-embedding methods train sharded (the planner's runs: tests/test_memory_plan.py)."""

import math
import shutil

import pytest
import timm
import torch
import torch.distributed as dist
from test_shipped_configs import losses
from torch import nn

from vistrain.checkpoint import consolidated_state_dict
from vistrain.config import ConfigError
from vistrain.distributed.sync_batchnorm import convert_sync_batchnorm
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp.deferred_init import build_on_meta, materialize
from vistrain.jobs import check_values
from vistrain.methods import build_model, load_config
from vistrain.models.trunks import trunk_feature_names
from vistrain.models.trunks.structure import repeated_blocks
from vistrain.models.units import unit_classes
from vistrain.runtime.sharding import build_for_run
from vistrain.training.resume import resume
from vistrain.training.trainer import _build, train

TIMM = ["config.MODEL.TRUNK.NAME=timm"]
TV = ["config.MODEL.TRUNK.NAME=torchvision"]
CONVNEXT = [*TIMM, "config.MODEL.TRUNK.TIMM.NAME=test_convnext"]  # its last stage needs 32 px
EFFICIENTNET = [*TIMM, "config.MODEL.TRUNK.TIMM.NAME=test_efficientnet", "config.MODEL.HEAD.DIMS=[256,32,16]"]
VIT = [
    *TIMM,
    "config.MODEL.TRUNK.TIMM.NAME=test_vit",
    "config.MODEL.TRUNK.TIMM.KWARGS={img_size: 16, patch_size: 4}",
]
MOBILENET = [
    *TV,
    "config.MODEL.TRUNK.TORCHVISION.NAME=mobilenet_v3_small",
    "config.MODEL.HEAD.DIMS=[1024,32,16]",
]


def _cfg(*overrides, recipe="test/simclr_tiny"):
    return load_config([f"config={recipe}", "config.MODEL.HEAD.DIMS=[64,32,16]", *overrides])


@pytest.mark.parametrize(
    "model, blocks, stages",
    [
        (lambda: timm.create_model("test_convnext"), {"ConvNeXtBlock"}, {"ConvNeXtStage"}),
        (lambda: timm.create_model("test_vit"), {"Block"}, {"Block"}),
        (lambda: timm.create_model("test_efficientnet"), {"EdgeResidual", "InvertedResidual"}, None),
        (lambda: timm.create_model("test_resnet"), {"BasicBlock"}, None),
        (lambda: __import__("torchvision").models.convnext_tiny(), {"CNBlock"}, None),
        (lambda: __import__("torchvision").models.swin_t(), {"SwinTransformerBlock", "PatchMerging"}, None),
        (
            lambda: __import__("torchvision").models.mobilenet_v3_small(),
            {"Conv2dNormActivation", "SqueezeExcitation"},
            {"InvertedResidual"},
        ),
    ],
)
def test_repeated_blocks_are_found_from_the_structure(model, blocks, stages):
    with torch.device("meta"):
        found = repeated_blocks(model())
    assert {c.__name__ for c in found["block"]} == blocks
    assert {c.__name__ for c in found["stage"]} == (stages or blocks)


def test_a_timm_trunk_offers_its_stages_and_a_vit_its_tokens():
    convnext = build_model(_cfg(*CONVNEXT, "config.MODEL.TRUNK.OUT_FEATURES=[avgpool,stage2,stage4]").MODEL)
    x = torch.randn(2, 3, 32, 32)
    out = convnext.trunk(x)
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "stage2": (2, 32, 4, 4),
        "stage4": (2, 64, 1, 1),
        "avgpool": (2, 64),
    }
    torch.testing.assert_close(out["avgpool"], convnext.trunk.timm(x), rtol=0, atol=0)  # timm's pooled
    stage0 = [n for n, _ in convnext.trunk.named_parameters() if n.startswith("timm.stages.0.blocks.")]
    between = convnext.trunk.lr_layer_of("timm.stages.1.downsample.1.weight")  # between two blocks
    assert between == convnext.trunk.lr_layer_of(stage0[-1]) > 0
    vit_cfg = _cfg(*VIT, "config.MODEL.TRUNK.OUT_FEATURES=[avgpool,cls,tokens,stage6]")
    assert trunk_feature_names(vit_cfg.MODEL.TRUNK) == [
        *(f"stage{i}" for i in range(1, 7)),
        *("cls", "avgpool", "tokens", "sequence"),
    ]
    vit = build_model(vit_cfg.MODEL).trunk
    x = torch.randn(2, 3, 16, 16)
    out, tokens = vit(x), vit.timm.forward_features(x)
    torch.testing.assert_close(out["cls"], tokens[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(out["avgpool"], tokens[:, 1:].mean(1), rtol=0, atol=0)
    assert out["tokens"].shape == (2, 64, 4, 4) and out["stage6"].shape == (2, 64, 4, 4)
    assert vit.vector_features == ["cls", "avgpool"] and vit.num_lr_layers == 7
    assert vit.lr_layer_of("timm.blocks.2.attn.qkv.weight") == 3 and vit.lr_layer_of("timm.cls_token") == 0
    assert vit.lr_layer_of("timm.norm.weight") == 7


def test_a_torchvision_trunk_drops_only_the_classifiers_last_layer():
    cfg = _cfg(*MOBILENET, "config.MODEL.TRUNK.OUT_FEATURES=[avgpool,stage2]")
    trunk = build_model(cfg.MODEL).trunk
    assert trunk_feature_names(cfg.MODEL.TRUNK) == ["stage1", "stage2", "stage3", "stage4", "avgpool"]
    out = trunk.eval()(torch.randn(2, 3, 64, 64))
    assert out["avgpool"].shape == (2, 1024) and out["stage2"].shape == (2, 24, 8, 8)
    import torchvision

    reference = torchvision.models.mobilenet_v3_small()
    reference.classifier[3] = nn.Identity()
    missing, unexpected = reference.load_state_dict(trunk.torchvision.state_dict(), strict=True), ()
    assert not unexpected and not missing.missing_keys


TV_REGNET = [*TV, "config.MODEL.TRUNK.TORCHVISION.NAME=regnet_x_400mf", "config.MODEL.HEAD.DIMS=[400,32,16]"]


@pytest.mark.parametrize("overrides", [CONVNEXT, EFFICIENTNET, VIT, MOBILENET, TV_REGNET])
def test_per_unit_initialisation_gives_the_plain_builds_weights(overrides):
    """(torchvision's RegNet computes its widths on tensors: built on the CPU inside the meta
    build, its draws advancing the generator once, then recorded as copies.)"""
    cfg = _cfg(*overrides)
    torch.manual_seed(0)
    plain = build_model(cfg.MODEL)
    torch.manual_seed(0)
    meta = build_on_meta(build_model, cfg.MODEL)
    named = lambda m: list(m.named_parameters()) + list(m.named_buffers())
    for (name, value), (_, recorded) in zip(named(plain), named(meta)):
        torch.testing.assert_close(materialize(recorded), value, rtol=0, atol=0, msg=name)


def test_torchs_trunc_normal_on_meta_builds_the_whole_model_with_one_warning(caplog):
    """torchvision's Swin initialises with torch's trunc_normal_, which skips meta tensors: the
    run builds the whole model (the same weights as a plain build) and says why."""
    cfg = _cfg(*TV, "config.MODEL.TRUNK.TORCHVISION.NAME=swin_t", "config.MODEL.HEAD.DIMS=[768,32,16]")
    cfg.defrost()
    cfg.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP = True
    torch.manual_seed(0)
    model = build_for_run(build_model, cfg.MODEL)
    after = torch.rand(1)
    torch.manual_seed(0)
    plain = build_model(cfg.MODEL)
    assert not any(p.is_meta for p in model.parameters()) and torch.rand(1) == after
    assert "trunc_normal_" in caplog.text and "building the whole model" in caplog.text
    for (name, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_timms_batchnorm_with_activation_keeps_it_under_sync_bn():
    model = timm.create_model("test_efficientnet", num_classes=0)
    x = torch.randn(4, 3, 32, 32)
    model(x)  # moves the running statistics away from 0 / 1
    model.eval()
    before = model(x)
    convert_sync_batchnorm(model)
    assert type(model.bn1).__name__ == "SyncedBatchNormAct2d" and not isinstance(model.bn1.act, nn.Identity)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    model.train()
    plain = timm.create_model("test_efficientnet", num_classes=0)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), plain.train()(x), rtol=0, atol=0)  # one process: plain BN


def test_in_channels_reach_every_family():
    for overrides in (CONVNEXT, MOBILENET, ["config.MODEL.HEAD.DIMS=[16,32,16]"]):  # the last: a RegNet
        model = build_model(_cfg(*overrides, "config.MODEL.TRUNK.IN_CHANNELS=4").MODEL)
        first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        assert first.in_channels == 4
        assert model(torch.randn(2, 4, 32, 32)).shape[0] == 2


@pytest.mark.parametrize(
    "overrides, line",
    [
        ([*TIMM, "config.MODEL.TRUNK.TIMM.NAME=convnxt_tiny"], "close names: convnext_tiny"),
        ([*TV, "config.MODEL.TRUNK.TORCHVISION.NAME=mobilenet_v3_smal"], "mobilenet_v3_small"),
        (
            [
                *TIMM,
                "config.MODEL.TRUNK.TIMM.NAME=test_vit",
                "config.MODEL.TRUNK.TIMM.KWARGS={num_classes: 10}",
            ],
            "remove it",
        ),
        ([*CONVNEXT, "config.MODEL.TRUNK.TIMM.KWARGS={in_chans: 1}"], "set MODEL.TRUNK.IN_CHANNELS only"),
        ([*CONVNEXT, "config.MODEL.TRUNK.OUT_FEATURES=[stage9]"], "OUT_FEATURES"),
        ([*CONVNEXT, "config.MODEL.TRUNK.TIMM.BLOCKS=[ConvNextBlock]"], "ConvNeXtBlock"),
        (
            [*CONVNEXT, "config.MODEL.TRUNK.IN_CHANNELS=1", "config.DATA.CHANNELS=3"],
            "the views have DATA.CHANNELS=3",
        ),
        (
            [*CONVNEXT, "config.MODEL.TRUNK.TIMM.KWARGS={in_chans:3}"],
            "has no value: write the mapping",
        ),
        ([*CONVNEXT, "config.MODEL.TRUNK.TIMM.KWARGS={foo: 1}"], "refused MODEL.TRUNK.TIMM.KWARGS"),
        (
            [*MOBILENET, "config.MODEL.TRUNK.TORCHVISION.BLOCKS=[Block]"],
            "TORCHVISION.BLOCKS: the model has no",
        ),
    ],
)
def test_a_wrong_library_model_is_one_line(overrides, line):
    with pytest.raises((ConfigError, ValueError), match=line) as info:
        cfg = _cfg(*overrides)
        check_values(cfg, files=False)
        build_model(cfg.MODEL)
    assert "\n" not in str(info.value)


def test_blocks_named_by_class_override_the_structure():
    cfg = _cfg(*CONVNEXT, "config.MODEL.TRUNK.TIMM.BLOCKS=[ConvNeXtStage]")
    model = build_model(cfg.MODEL)
    names = {c.__name__ for c in unit_classes(False, "block", (), model)}
    assert "ConvNeXtStage" in names and "ConvNeXtBlock" not in names


# --------------------------------------------------------------------------------------------
# 2 ranks: sharded = DDP; resumed on 3 ranks

RUNS = {  # name -> (recipe, overrides, steps)
    "simclr_convnext": (
        "test/simclr_tiny",
        [*CONVNEXT, "config.MODEL.HEAD.DIMS=[64,32,16]", "config.DATA.TRAIN.IMAGE_SIZE=32",
         "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[32]"],
        3,
    ),
    "byol_efficientnet": ("test/byol_tiny", EFFICIENTNET, 3),
    "simclr_mobilenet": ("test/simclr_tiny", MOBILENET, 3),
    # DINO (with DINOv2's terms: iBOT masks, KoLeo) and MAE through timm's public ViT modules
    "mae_vit": ("test/mae_tiny", [*VIT, "config.MODEL.HEAD.DIMS=[64,8]"], 3),
    "dinov2_vit": (
        "test/dinov2_tiny",
        [*VIT, "config.MODEL.TRUNK.TIMM.MASK_TOKEN=True", "config.MODEL.HEAD.DIMS=[64,32,16]"],
        3,
    ),
    # 28M parameters, no small size: 2 steps; built whole (torch's trunc_normal_), then sharded
    "simclr_swin_t": (
        "test/simclr_tiny",
        [*TV, "config.MODEL.TRUNK.TORCHVISION.NAME=swin_t", "config.MODEL.HEAD.DIMS=[768,32,16]",
         "config.DATA.TRAIN.SYNTHETIC_SIZE=32"],
        2,
    ),
}  # fmt: skip


def _argv(recipe, overrides, run_dir, sharded):
    return [
        f"config={recipe}",
        f"config.CHECKPOINT.DIR={run_dir}",
        f"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP={sharded}",
        "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True",
        "config.DATA.TRAIN.SYNTHETIC_SIZE=48",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
        "config.OPTIMIZER.num_epochs=1",
        "config.LOG_FREQUENCY=1",
        *overrides,
    ]


def _train_each(rank, world, argvs):
    for argv in argvs:
        train(load_config(argv))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every run of RUNS on 2 ranks, sharded and under DDP (one group of ranks)."""
    root = tmp_path_factory.mktemp("runs")
    argvs = [
        _argv(recipe, overrides, root / f"{name}_{sharded}", sharded)
        for name, (recipe, overrides, _) in RUNS.items()
        for sharded in (True, False)
    ]
    argvs += [
        _argv(recipe, overrides, root / name, True) for name, (recipe, overrides) in OTHER_METHODS.items()
    ]
    run_on_ranks(_train_each, 2, argvs)
    return root


# the other joint-embedding methods on a library trunk, sharded (3 steps: they train, and finitely)
OTHER_METHODS = {
    name: (f"test/{name}_tiny", [*EFFICIENTNET, f"config.MODEL.HEAD.DIMS=[256,32,{out}]"])
    for name, out in (("mocov3", 16), ("barlow_twins", 32), ("vicreg", 32), ("lejepa", 16), ("swav", 16))
}


def test_every_library_trunk_trains_sharded_as_under_ddp(trained):
    for name, (_, _, steps) in RUNS.items():
        sharded, ddp = losses(trained / f"{name}_True"), losses(trained / f"{name}_False")
        assert len(sharded) == steps, name
        torch.testing.assert_close(sharded, ddp, rtol=1e-5, atol=0, msg=name)


def test_every_joint_embedding_method_trains_on_a_library_trunk(trained):
    for name in OTHER_METHODS:
        found = losses(trained / name)
        assert len(found) == 3 and all(math.isfinite(x) for x in found), name


def _resume_on_three(rank, world, argvs):
    """Each run's student and teacher right after resuming on this world size."""
    states = []
    for argv in argvs:
        cfg = load_config(argv)
        run = _build(cfg, torch.device("cpu"))
        _, iteration = resume(cfg.CHECKPOINT.DIR, run)  # the checkpoint's own iteration
        teacher = run.teacher.model.state_dict() if run.teacher is not None else {}
        states.append((iteration, run.model.state_dict(), teacher))  # collective: full weights
        dist.barrier()
    return states


def test_a_library_trunk_trained_on_two_ranks_resumes_on_three(trained, tmp_path):
    """The sharded checkpoints of 2 ranks load on 3 as saved (student, and BYOL's and DINO's
    teacher with its BatchNorm statistics)."""
    names = ["simclr_convnext", "byol_efficientnet", "dinov2_vit"]  # units, a teacher, a mask token
    for name in names:
        step = RUNS[name][2]
        shutil.copytree(
            trained / f"{name}_True" / f"checkpoint_{step}", tmp_path / name / f"checkpoint_{step}"
        )
    argvs = [_argv(RUNS[n][0], RUNS[n][1], tmp_path / n, True) for n in names]
    results = run_on_ranks(_resume_on_three, 3, argvs)
    for i, name in enumerate(names):
        saved = consolidated_state_dict(str(tmp_path / name / f"checkpoint_{RUNS[name][2]}"))
        for iteration, student, teacher in (rank[i] for rank in results):
            assert iteration == RUNS[name][2] and bool(teacher) == (name != "simclr_convnext")
            for key, value in student.items():
                torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=f"{name} {key}")
            for key, value in teacher.items():
                torch.testing.assert_close(
                    value, saved[f"teacher.{key}"], rtol=0, atol=0, msg=f"{name} {key}"
                )
