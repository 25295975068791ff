"""RegNet trunk (vs torchvision), heads, SSLModel multi-crop forward and build errors."""

import pytest
import torch
import torchvision.models as tvm
import torchvision.models.regnet as tv_regnet
from torch import nn
from torchvision.models.regnet import ResBottleneckBlock, SimpleStemIN

from vistrain.methods import build_head, build_model, get_defaults
from vistrain.methods.swav import SwAVHead, SwAVPrototypes
from vistrain.models import SSLModel
from vistrain.models.heads import MLP
from vistrain.models.trunks import build_trunk
from vistrain.models.trunks.regnet import (
    PUBLISHED_REGNETS,
    RegNetTrunk,
    block_params_from_config,
    describe,
    to_torchvision_state_dict,
)

pytestmark = pytest.mark.usefixtures("one_thread")


TINY_WIDTHS = [8, 32, 64, 128]  # stage widths of the tiny custom RegNet below (stem: 8)


def model_cfg(head="simclr", out_features=("avgpool",), name="custom"):
    cfg = get_defaults().MODEL
    regnet = cfg.TRUNK.REGNET
    regnet.NAME, regnet.DEPTH, regnet.W_0, regnet.W_A, regnet.W_M = name, 5, 8, 24.0, 2.0
    regnet.GROUP_WIDTH, regnet.STEM_WIDTH = 8, 8
    cfg.TRUNK.OUT_FEATURES = list(out_features)
    cfg.HEAD.NAME, cfg.HEAD.DIMS, cfg.HEAD.NMB_PROTOTYPES = head, [128, 32, 16], [10, 7]
    return cfg


def published_cfg(name):
    cfg = get_defaults().MODEL
    cfg.TRUNK.REGNET.NAME = name
    return cfg


def trunk_parameter_count(module):
    return sum(p.numel() for name, p in module.named_parameters() if not name.startswith("fc."))


# ------------------------------------------------------------------------- trunk vs torchvision


def test_published_design_parameters_match_torchvision_builders(monkeypatch):
    # Capture the BlockParams each torchvision builder computes, without building the model.
    monkeypatch.setattr(tv_regnet, "_regnet", lambda params, weights, progress, **kw: params)
    names = [n for n in PUBLISHED_REGNETS if n not in ("regnet_y_256gf", "regnet_y_10b")]
    assert len(names) == 15
    for name in names:
        expected = describe(getattr(tv_regnet, name)())
        assert describe(block_params_from_config(published_cfg(name).TRUNK.REGNET)) == expected, name


@pytest.mark.parametrize("name", ["regnet_y_400mf", "regnet_y_800mf", "regnet_x_400mf"])
def test_parameter_counts_and_names_match_torchvision(name):
    trunk = build_trunk(published_cfg(name).TRUNK)
    reference = getattr(tvm, name)()
    assert trunk_parameter_count(trunk) == trunk_parameter_count(reference)
    ours = {k: v.shape for k, v in trunk.state_dict().items()}
    theirs = {k: v.shape for k, v in reference.state_dict().items() if not k.startswith("fc.")}
    assert ours == theirs
    reference.fc = nn.Identity()
    reference.load_state_dict(to_torchvision_state_dict(trunk.state_dict()), strict=True)
    if name == "regnet_y_400mf":
        assert trunk.feature_dims["avgpool"] == 440


@pytest.mark.parametrize(
    "name, width, low, high",
    [("regnet_y_256gf", 10444, 1.2e9, 1.35e9), ("regnet_y_10b", 28280, 9.0e9, 1.05e10)],
)
def test_seer_sizes_counted_on_meta_device(name, width, low, high):
    # SEER: RegNetY-256GF has 1.3B parameters, the 10B model ~10B (their linear heads read
    # 10444 / 28280 channels). Built on the meta device: shapes only, no memory.
    params = block_params_from_config(published_cfg(name).TRUNK.REGNET)
    with torch.device("meta"):
        trunk = RegNetTrunk(params, stem_width=32, out_features=["avgpool"])
    assert low < trunk_parameter_count(trunk) < high
    assert trunk.feature_dims["avgpool"] == width


def test_trunk_keeps_torchvision_classes_and_names():
    trunk = build_trunk(model_cfg().TRUNK)
    assert isinstance(trunk.stem, SimpleStemIN)
    assert [name for name, _ in trunk.trunk_output.named_children()] == [
        "block1",
        "block2",
        "block3",
        "block4",
    ]
    blocks = [m for m in trunk.modules() if isinstance(m, ResBottleneckBlock)]
    assert len(blocks) == 5  # depths [1, 1, 2, 1]
    assert all(isinstance(m, nn.BatchNorm2d) for m in trunk.modules() if "BatchNorm" in type(m).__name__)


def test_out_features_shapes_and_feature_dims():
    trunk = build_trunk(model_cfg(out_features=["stem", "s1", "s2", "s3", "s4", "avgpool"]).TRUNK)
    out = trunk(torch.randn(2, 3, 32, 32))
    assert out["stem"].shape == (2, 8, 16, 16)
    for i, width in enumerate(TINY_WIDTHS, start=1):
        side = 32 // 2 ** (i + 1)
        assert out[f"s{i}"].shape == (2, width, side, side)
    assert out["avgpool"].shape == (2, 128)
    torch.testing.assert_close(out["avgpool"], out["s4"].mean((2, 3)))
    expected_dims = {"stem": 8, "s1": 8, "s2": 32, "s3": 64, "s4": 128, "avgpool": 128}
    assert trunk.feature_dims == expected_dims


def test_trunk_skips_stages_after_the_last_requested_feature():
    trunk = build_trunk(model_cfg(out_features=["s2"]).TRUNK)
    ran = []
    for name in ("block3", "block4"):
        getattr(trunk.trunk_output, name).register_forward_hook(lambda *a, n=name: ran.append(n))
    out = trunk(torch.randn(1, 3, 32, 32))
    assert list(out) == ["s2"] and ran == []


def test_state_dict_converts_to_torchvision_and_gives_the_same_features():
    cfg = model_cfg()
    model = build_model(cfg)
    model.trunk(torch.randn(4, 3, 32, 32))  # train-mode pass: non-trivial BN running stats
    params = block_params_from_config(cfg.TRUNK.REGNET)
    reference = tv_regnet.RegNet(params, stem_width=8, norm_layer=nn.BatchNorm2d)
    reference.fc = nn.Identity()
    reference.load_state_dict(to_torchvision_state_dict(model.state_dict(), prefix="trunk."), strict=True)
    model.eval(), reference.eval()
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(reference(x), model.trunk(x)["avgpool"], rtol=0, atol=0)


def test_to_torchvision_state_dict_rejects_foreign_keys():
    with pytest.raises(ValueError, match="not a RegNet trunk"):
        to_torchvision_state_dict({"stem.0.weight": torch.zeros(1), "fc.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="no RegNet trunk keys"):
        to_torchvision_state_dict({"head.layers.0.weight": torch.zeros(1)}, prefix="trunk.")


def test_trunk_config_errors():
    with pytest.raises(ValueError, match="valid names: custom, regnet_x_16gf"):
        build_trunk(published_cfg("regnet_y_401mf").TRUNK)
    cfg = model_cfg()
    cfg.TRUNK.REGNET.W_0 = 12
    with pytest.raises(ValueError, match="W_0 a positive multiple of 8"):
        build_trunk(cfg.TRUNK)
    with pytest.raises(ValueError, match="OUT_FEATURES must be a non-empty subset"):
        build_trunk(model_cfg(out_features=["s5"]).TRUNK)
    with pytest.raises(ValueError, match="OUT_FEATURES must be a non-empty subset"):
        build_trunk(model_cfg(out_features=[]).TRUNK)
    cfg = model_cfg()
    cfg.TRUNK.NAME = "resnets"
    with pytest.raises(
        ValueError,
        match=r"unknown MODEL.TRUNK.NAME 'resnets'; valid names: \['regnet', 'resnet', 'timm', 'torchvision', 'vit'\]",
    ):
        build_model(cfg)


# ------------------------------------------------------------------------------------------- heads


@pytest.mark.parametrize("use_bn", [True, False])
def test_simclr_mlp_layers(use_bn):
    head = MLP([440, 512, 256, 128], use_bn=use_bn)
    kinds = [type(m) for m in head.layers]
    hidden = [nn.Linear, nn.BatchNorm1d, nn.ReLU] if use_bn else [nn.Linear, nn.ReLU]
    assert kinds == hidden * 2 + [nn.Linear]
    assert head(torch.randn(5, 440)).shape == (5, 128)


def test_swav_head_outputs_and_prototype_normalisation():
    cfg = model_cfg(head="swav")
    head = build_head(cfg.HEAD)
    assert isinstance(head, SwAVHead) and all(isinstance(p, SwAVPrototypes) for p in head.prototypes)
    assert all(p.bias is None for p in head.prototypes)
    for p in head.prototypes:  # unit-norm from construction on
        torch.testing.assert_close(p.weight.norm(dim=1), torch.ones(p.weight.shape[0]))
    z, scores = head(torch.randn(6, 128))
    torch.testing.assert_close(z.norm(dim=1), torch.ones(6))
    assert [s.shape for s in scores] == [(6, 10), (6, 7)]
    torch.testing.assert_close(scores[1], z @ head.prototypes[1].weight.t())

    with torch.no_grad():
        for p in head.prototypes:
            p.weight.mul_(torch.rand(p.weight.shape[0], 1) * 3 + 0.1)
    before = [p.weight.detach().clone() for p in head.prototypes]
    head.normalize_prototypes()
    for p, old in zip(head.prototypes, before):
        torch.testing.assert_close(p.weight, old / old.norm(dim=1, keepdim=True))
        assert p.weight.grad is None


def test_swav_prototype_scores_stay_fp32_under_autocast():
    head = build_head(model_cfg(head="swav").HEAD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z, scores = head(torch.randn(4, 128))
    assert all(s.dtype == torch.float32 for s in scores)


def test_head_config_errors():
    cfg = model_cfg()
    cfg.HEAD.DIMS = [440, 128]
    with pytest.raises(ValueError, match=r"MODEL.HEAD.DIMS\[0\] is 440 .* 128 channels"):
        build_model(cfg)
    cfg = model_cfg()
    cfg.HEAD.NAME = "moco"
    with pytest.raises(
        ValueError,
        match=r"valid names: \['barlow_twins', 'byol', 'dino', 'identity', 'ijepa_predictor', 'lejepa', 'mae_decoder', 'moco_v3', 'msn', 'nnclr', 'simclr', 'simmim_decoder', 'simsiam', 'supervised', 'swav', 'vicreg'\]",
    ):
        build_model(cfg)
    with pytest.raises(ValueError, match="at least two positive sizes"):
        MLP([128], use_bn=True)
    cfg = model_cfg(head="swav")
    cfg.HEAD.NMB_PROTOTYPES = []
    with pytest.raises(ValueError, match="NMB_PROTOTYPES"):
        build_model(cfg)
    with pytest.raises(ValueError, match="add it to MODEL.TRUNK.OUT_FEATURES"):
        build_model(model_cfg(out_features=["s4"]))


# ------------------------------------------------------------------------- SSLModel, multi-crop


def multicrop(n=4):
    gen = torch.Generator().manual_seed(0)
    sizes = [32, 32, 16, 16, 16]
    return [torch.randn(n, 3, s, s, generator=gen) for s in sizes]


def count_calls(module):
    calls = []
    module.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    return calls


def test_simclr_model_concatenates_crops_in_order_and_batches_resolutions():
    torch.manual_seed(0)
    model = build_model(model_cfg())
    assert isinstance(model, SSLModel) and isinstance(model.head, MLP)
    crops = multicrop()
    calls = count_calls(model.trunk)
    out = model(crops)
    assert out.shape == (5 * 4, 16)
    assert calls == [8, 12]  # one trunk pass per run of equal resolutions
    model.eval()  # per-sample BatchNorm: batching must not change any row
    expected = torch.cat([model.head(model.trunk(c)["avgpool"]) for c in crops])
    torch.testing.assert_close(model(crops), expected)
    assert model(crops[0]).shape == (4, 16)


def test_non_consecutive_resolutions_run_separately():
    model = build_model(model_cfg())
    crops = multicrop()
    calls = count_calls(model.trunk)
    model([crops[0], crops[2], crops[1]])
    assert calls == [4, 4, 4]


def test_swav_model_outputs():
    model = build_model(model_cfg(head="swav"))
    z, scores = model(multicrop())
    assert z.shape == (20, 16)
    torch.testing.assert_close(z.norm(dim=1), torch.ones(20))
    assert [s.shape for s in scores] == [(20, 10), (20, 7)]


def test_identity_head_returns_trunk_features():
    model = build_model(model_cfg(head="identity", out_features=["s3", "avgpool"]))
    out = model(torch.randn(2, 3, 32, 32))
    assert set(out) == {"s3", "avgpool"} and out["s3"].shape == (2, 64, 2, 2)
    with pytest.raises(ValueError, match="takes one tensor, got 2 crops"):
        model(multicrop()[:2])


def test_bad_crop_inputs():
    model = build_model(model_cfg())
    with pytest.raises(ValueError, match="same number of images"):
        model([torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)])
    with pytest.raises(ValueError, match="non-empty list"):
        model([])
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\)"):
        model(torch.randn(3, 32, 32))


def test_block_params_computed_under_a_meta_default_device():
    # torchvision computes the widths with tensors: they must not land on the meta device.
    with torch.device("meta"):
        params = block_params_from_config(published_cfg("regnet_y_400mf").TRUNK.REGNET)
        trunk = RegNetTrunk(params, stem_width=32, out_features=["avgpool"])
    assert params.widths == [48, 104, 208, 440] and trunk.feature_dims["avgpool"] == 440
