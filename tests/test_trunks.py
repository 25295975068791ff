"""ResNet and ViT trunks: torchvision names and export, features, config errors, sharded units, and
AUTO_SETUP_FSDP equal to DDP on 2 gloo ranks (the RegNet's are in test_models / test_auto_setup)."""

import json

import pytest
import torch
import torchvision.models as tvm
from test_auto_setup import _amp_worker, _parity_worker, build, recipe
from torch import nn

from vistrain.benchmarks import linear_eval
from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import KEEP_FP32
from vistrain.fsdp.deferred_init import build_on_meta, materialize
from vistrain.jobs import check_values
from vistrain.methods import build_meta_model, build_model, get_defaults, load_config
from vistrain.models.trunks import build_trunk, to_torchvision_state_dict, trunk_feature_names
from vistrain.models.trunks.resnet import PUBLISHED_RESNETS
from vistrain.models.trunks.vit import VIT_SIZES, LayerNorm32
from vistrain.models.units import LARGE_LAYER_PARAMS, is_large_layer
from vistrain.training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def resnet_cfg(name="resnet18", out_features=("avgpool",), **options):
    cfg = get_defaults().MODEL.TRUNK
    cfg.NAME, cfg.RESNET.NAME, cfg.OUT_FEATURES = "resnet", name, list(out_features)
    for key, value in options.items():
        cfg.RESNET[key] = value
    return cfg


def vit_cfg(name="custom", out_features=("cls",), **options):
    cfg = get_defaults().MODEL.TRUNK
    cfg.NAME, cfg.VIT.NAME, cfg.OUT_FEATURES = "vit", name, list(out_features)
    dims = (
        {"DEPTH": 3, "WIDTH": 32, "HEADS": 4, "PATCH_SIZE": 4, "IMAGE_SIZE": 16} if name == "custom" else {}
    )
    for key, value in {**dims, **options}.items():
        cfg.VIT[key] = value
    return cfg


def shapes(module, skip):
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.startswith(skip)}


# ------------------------------------------------------------------------ ResNet vs torchvision


@pytest.mark.parametrize("name", sorted(PUBLISHED_RESNETS))
def test_resnet_names_and_shapes_match_torchvision(name):
    with torch.device("meta"):
        ours, theirs = build_trunk(resnet_cfg(name)), getattr(tvm, name)()
    assert shapes(ours, "fc.") == shapes(theirs, "fc.")
    assert ours.feature_dims["avgpool"] == theirs.fc.in_features


def test_resnet18_export_loads_into_torchvision_and_gives_its_features():
    torch.manual_seed(0)
    trunk = build_trunk(resnet_cfg(out_features=["res4", "avgpool"], ZERO_INIT_RESIDUAL=True)).eval()
    reference = tvm.resnet18()
    reference.fc = nn.Identity()
    reference.load_state_dict(
        to_torchvision_state_dict({f"trunk.{k}": v for k, v in trunk.state_dict().items()}, "trunk.")
    )
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(reference.eval()(x), trunk(x)["avgpool"])
    assert trunk.layer1[0].bn2.weight.abs().sum() == 0  # ZERO_INIT_RESIDUAL


def test_resnet_features_width_multiplier_and_small_stem():
    cfg = resnet_cfg("resnet50", ["conv1", "res2", "res3", "res4", "res5", "avgpool"], WIDTH_MULTIPLIER=0.125)
    trunk = build_trunk(cfg)
    assert trunk_feature_names(cfg) == list(trunk.feature_dims)
    out = trunk(torch.randn(2, 3, 32, 32))
    expected = {"conv1": (8, 8), "res2": (32, 8), "res3": (64, 4), "res4": (128, 2), "res5": (256, 1)}
    for name, (channels, side) in expected.items():
        assert out[name].shape == (2, channels, side, side) and trunk.feature_dims[name] == channels
    assert out["avgpool"].shape == (2, 256)
    small = build_trunk(resnet_cfg(out_features=["conv1", "res5"], WIDTH_MULTIPLIER=0.25, SMALL_STEM=True))
    out = small(torch.randn(2, 3, 16, 16))
    assert out["conv1"].shape == (2, 16, 16, 16) and out["res5"].shape == (2, 128, 2, 2)


# --------------------------------------------------------------------------- ViT vs torchvision


def test_vit_sizes_and_base_16_names_match_torchvision():
    counts = {}
    for name in VIT_SIZES:
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in build_trunk(vit_cfg(name)).parameters())
    assert 5.5e6 < counts["tiny"] < 5.6e6 and 21e6 < counts["small"] < 22e6
    assert 1.1e9 < counts["giant"] < 1.2e9  # dinov2's ViT-g size, as the DINO plans quote
    with torch.device("meta"):
        ours, theirs = build_trunk(vit_cfg("base")), tvm.vit_b_16()
    assert shapes(ours, "heads.") == shapes(theirs, "heads.")


def test_vit_export_loads_into_torchvision_and_gives_its_class_token():
    torch.manual_seed(0)
    trunk = build_trunk(vit_cfg()).eval()
    reference = tvm.VisionTransformer(16, 4, 3, 4, 32, 128)
    reference.heads = nn.Identity()
    reference.load_state_dict(to_torchvision_state_dict(trunk.state_dict()), strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(reference.eval()(x), trunk(x)["cls"])
    no_token = build_trunk(vit_cfg(out_features=["avgpool"], CLASS_TOKEN=False))
    with pytest.raises(ValueError, match="without class token"):
        to_torchvision_state_dict(no_token.state_dict())


def test_vit_features_and_other_input_sizes():
    names = ["cls", "avgpool", "tokens", "sequence", "block1", "block2", "block3"]
    cfg = vit_cfg(out_features=names)
    trunk = build_trunk(cfg).eval()
    assert trunk_feature_names(cfg) == names == list(trunk.feature_dims)
    x = torch.randn(2, 3, 16, 16)
    out = trunk(x)
    assert out["tokens"].shape == (2, 32, 4, 4)
    assert out["sequence"].shape == (2, 17, 32)
    assert all(out[n].shape == (2, 32) for n in names if n not in ("tokens", "sequence"))
    torch.testing.assert_close(out["avgpool"], out["tokens"].mean((2, 3)))
    torch.testing.assert_close(out["block3"], out["cls"])  # the last block, final LayerNorm
    # blocks after the last requested one are skipped; the earlier ones give the same numbers
    early = build_trunk(vit_cfg(out_features=["block1"]))
    early.load_state_dict(trunk.state_dict())
    torch.testing.assert_close(early.eval()(x)["block1"], out["block1"])
    # another side (a local crop): position embeddings interpolated
    assert trunk(torch.randn(2, 3, 8, 12))["tokens"].shape == (2, 32, 2, 3)
    with pytest.raises(ConfigError, match=r"PATCH_SIZE \(4\) must divide the crop sides, got 10x16"):
        trunk(torch.randn(1, 3, 10, 16))


def test_vit_layer_norm_computes_in_float32():
    norm = LayerNorm32(64, eps=1e-6)
    x = torch.randn(4, 64) * 100 + 1000  # a large mean: bf16 statistics would lose it
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), nn.functional.layer_norm(x.bfloat16().float(), (64,), eps=1e-6), atol=0.02, rtol=0
    )


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["config.MODEL.TRUNK.RESNET.NAME=resnet19"], "MODEL.TRUNK.RESNET.NAME must be one of resnet101, resnet152, resnet18"),
        (["config.MODEL.TRUNK.VIT.NAME=medium"], "MODEL.TRUNK.VIT.NAME must be one of base, custom, giant"),
        (["config.MODEL.TRUNK.NAME=vit", "config.MODEL.TRUNK.VIT.NAME=custom"], "invalid ViT dims"),
        (["config.MODEL.TRUNK.NAME=vit", "config.MODEL.TRUNK.VIT.PATCH_SIZE=5"], "IMAGE_SIZE (224) must be a positive multiple of PATCH_SIZE (5)"),
        (["config.MODEL.TRUNK.NAME=resnet", "config.MODEL.TRUNK.OUT_FEATURES=[s4]"], "OUT_FEATURES must be a non-empty list of conv1, res2"),
        (["config.MODEL.TRUNK.NAME=vit", "config.MODEL.TRUNK.VIT.CLASS_TOKEN=False", "config.MODEL.TRUNK.OUT_FEATURES=[cls]"], "avgpool, tokens, sequence, block1"),
        (["config.MODEL.TRUNK.NAME=resnet"], "MODEL.HEAD.DIMS[0] is 16 but the trunk's 'avgpool' feature has 2048 channels"),
        (["config.MODEL.TRUNK.NAME=vit", "config.MODEL.HEAD.DIMS=[384,32,16]", "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[24]"],
         "MODEL.TRUNK.VIT.PATCH_SIZE (16) must divide the crop sides, got 24x24"),
    ],
)  # fmt: skip
def test_bad_trunk_configs_are_one_line_errors(overrides, message):
    cfg = load_config(["config=test/simclr_tiny", *overrides])
    with pytest.raises(ConfigError) as error:
        check_values(cfg)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_unknown_names_from_the_builders():
    with pytest.raises(ValueError, match="unknown MODEL.TRUNK.RESNET.NAME 'resnet19'; valid names: resnet18"):
        build_trunk(resnet_cfg("resnet19"))
    with pytest.raises(ValueError, match="unknown MODEL.TRUNK.VIT.NAME 'medium'; valid names: custom, tiny"):
        build_trunk(vit_cfg("medium"))


# ------------------------------------------------------------------ sharded units, DDP parity


def _unit_worker(rank, world, config, *overrides):
    model = build(recipe(config, *overrides), True)
    fp32 = sorted({type(u.module).__name__ for u in model.units() if u.precision == KEEP_FP32})
    return sorted({type(u.module).__name__ for u in model.units()}), len(model.units()), fp32


@pytest.mark.parametrize(
    "config, blocks, units",
    [("simclr_resnet", "BasicBlock", 8 + 1 + 1), ("simclr_vit", "ViTBlock", 2 + 1 + 1)],
)
def test_auto_setup_units_are_the_blocks(config, blocks, units):
    kinds, count, _ = run_on_ranks(_unit_worker, 1, config)[0]
    assert kinds == sorted([blocks, "MLP", "SSLModel"])
    assert count == units  # every block, the head MLP, the root


def test_resnet_batchnorm_is_a_synced_fp32_unit_under_amp():
    amp = ["config.MODEL.AMP_PARAMS.USE_AMP=True", "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True"]
    kinds, count, fp32 = run_on_ranks(_unit_worker, 1, "simclr_resnet", *amp)[0]
    assert fp32 == ["CPUSyncBatchNorm"] and "BasicBlock" in kinds
    # blocks, head MLP, root; BatchNorms: 2 per block, 3 shortcuts, the stem's, the head's
    assert count == 8 + 1 + 1 + 16 + 3 + 1 + 1


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("simclr_resnet", []),
        ("simclr_resnet", ["config.MODEL.FSDP_CONFIG.wrap_granularity=stage",
                           "config.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING=True",
                           "config.MODEL.ACTIVATION_CHECKPOINTING.GRANULARITY=stage"]),
        ("simclr_vit", ["config.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING=True"]),
        ("swav", ["config.MODEL.TRUNK.NAME=vit", "config.MODEL.TRUNK.VIT.NAME=custom", "config.MODEL.TRUNK.VIT.DEPTH=2",
                  "config.MODEL.TRUNK.VIT.WIDTH=16", "config.MODEL.TRUNK.VIT.HEADS=2", "config.MODEL.TRUNK.VIT.PATCH_SIZE=4",
                  "config.MODEL.TRUNK.VIT.IMAGE_SIZE=16"]),
    ],
)  # fmt: skip
def test_auto_setup_equals_ddp(config, overrides):
    loss_diff, state_diff, losses = run_on_ranks(_parity_worker, 2, config, overrides)[0]
    assert loss_diff < 1e-5 and state_diff < 1e-5, (loss_diff, state_diff)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("config", ["simclr_resnet", "simclr_vit"])
def test_unit_by_unit_initialisation_equals_the_plain_build(config):
    model_cfg = recipe(config).MODEL
    torch.manual_seed(0)
    plain = build_model(model_cfg)
    torch.manual_seed(0)
    meta = build_on_meta(build_model, model_cfg)
    tensors = [(*plain.named_parameters(), *plain.named_buffers()), (*meta.parameters(), *meta.buffers())]
    for (name, p), q in zip(*tensors):
        assert torch.equal(p, materialize(q)), name


def test_vit_bf16_amp_equals_ddp_amp():
    """AMP plus the engine's bf16 mixed precision (LayerNorms computing in fp32, attention in
    bf16) vs DDP's AMP run: early losses, and the first step vs fp32, within 1%."""
    loss_diff, _, bn_units_fp32, _, compute_dtype = run_on_ranks(_amp_worker, 2, "simclr_vit")[0]
    assert loss_diff < 1e-2 and bn_units_fp32 and compute_dtype == torch.bfloat16


def test_planner_counts_every_parameter_in_units():
    from vistrain.planner.shape import ModelShapes

    for config in ("simclr_resnet", "simclr_vit"):
        cfg = recipe(config)
        shapes = ModelShapes(cfg.MODEL)
        total = sum(p.numel() for p in build_meta_model(cfg.MODEL).parameters())
        for granularity in ("block", "stage", "model"):
            assert sum(shapes.units(False, granularity)) == total


# ------------------------------------------------------------------- the trainer on 2 gloo ranks


def _train(rank, world, argv):
    train(load_config(argv))


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("test/simclr_resnet_tiny", []),
        ("test/simclr_vit_tiny", []),
        # the check: a full-width ResNet-18 under a 512-wide SimCLR head
        ("test/simclr_resnet_tiny", ["config.MODEL.TRUNK.RESNET.WIDTH_MULTIPLIER=1.0", "config.MODEL.HEAD.DIMS=[512,512,128]"]),
    ],
)  # fmt: skip
def test_tiny_trunk_configs_train_sharded_as_under_ddp(config, overrides, tmp_path):
    for sharded in (True, False):
        run_on_ranks(
            _train,
            2,
            [
                f"config={config}",
                f"config.CHECKPOINT.DIR={tmp_path / str(sharded)}",
                f"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP={sharded}",
                "config.OPTIMIZER.num_epochs=1",
                "config.LOG_FREQUENCY=1",
                *overrides,
            ],
        )
    sharded, ddp = _losses(tmp_path / "True"), _losses(tmp_path / "False")
    assert len(sharded) == 4
    torch.testing.assert_close(sharded, ddp, rtol=1e-5, atol=0)


def _linear_eval(rank, world, argv):
    linear_eval(load_config(argv))


def test_linear_eval_reads_vit_vectors_unpooled_and_its_token_map_pooled(tmp_path):
    vit = [
        "config.MODEL.TRUNK.NAME=vit",
        "config.MODEL.TRUNK.VIT.NAME=custom",
        "config.MODEL.TRUNK.VIT.DEPTH=2",
    ]
    vit += [
        f"config.MODEL.TRUNK.VIT.{k}={v}"
        for k, v in {"WIDTH": 16, "HEADS": 2, "PATCH_SIZE": 4, "IMAGE_SIZE": 16}.items()
    ]
    argv = ["config=test/benchmark_tiny", f"config.CHECKPOINT.DIR={tmp_path}", *vit]
    argv.append("config.BENCHMARK.FEATURES=[cls, avgpool, tokens, block1+block2]")
    check_values(load_config(argv))
    run_on_ranks(_linear_eval, 2, argv)
    results = json.loads((tmp_path / "metrics.json").read_text())["results"]
    assert {name: r["dim"] for name, r in results.items()} == {
        "cls": 16,
        "avgpool": 16,
        "tokens": 64,
        "block1+block2": 32,
    }


def test_attention_output_projection_is_never_a_unit_of_its_own():
    attention = nn.MultiheadAttention(4096, 8)  # out_proj: 16.8M weights, a "large layer" by size
    assert sum(p.numel() for p in attention.out_proj.parameters()) >= LARGE_LAYER_PARAMS
    assert not is_large_layer(attention.out_proj) and is_large_layer(nn.Linear(4096, 4096))


def test_the_export_picks_the_family_from_the_keys_and_refuses_foreign_ones():
    keys = {"trunk.class_token": 0, "trunk.encoder.ln.weight": 1, "head.layers.0.weight": 2}
    assert to_torchvision_state_dict(keys, "trunk.") == {"class_token": 0, "encoder.ln.weight": 1}
    with pytest.raises(ValueError, match="'trunk.fc.weight' is not a ResNet trunk parameter"):
        to_torchvision_state_dict({"trunk.conv1.weight": 0, "trunk.fc.weight": 1}, "trunk.")
    with pytest.raises(ValueError, match="not a known trunk parameter"):
        to_torchvision_state_dict({"trunk.blocks.0.weight": 0}, "trunk.")
