"""Weights in (WEIGHTS_INIT from torch, safetensors and vistrain files, the key prefix found by
matching) and out (the trunk for torchvision, timm or as safetensors, with its model card), on
tiny real runs: a 2-rank sharded SimCLR run and a BYOL run (a momentum teacher) initialised from
it. The exported files are loaded with the very lines the model card prints."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from vistrain.checkpoint import (
    CheckpointError,
    consolidate,
    consolidated_state_dict,
    find_latest_checkpoint,
    load_pretrained,
    to_torchvision,
)
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import build_model, load_config
from vistrain.models.trunks.regnet import block_params_from_config
from vistrain.training.trainer import train

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "convert_checkpoint.py"


def _tiny(run_dir, *overrides, recipe="test/simclr_tiny"):
    return [
        f"config={recipe}",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.OPTIMIZER.num_epochs=1",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=3",
        *overrides,
    ]


def _train_worker(rank, world, argv):
    train(load_config(argv))


def _weights_cfg(path, **kw):
    weights = load_config(["config=test/simclr_tiny"]).MODEL.WEIGHTS_INIT.clone()
    weights.defrost()
    weights.PARAMS_FILE = str(path)
    for key, value in kw.items():
        setattr(weights, key, value)
    return weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``simclr``: 2 ranks, sharded, 1 epoch; ``byol``: 1 rank, initialised from simclr's
    consolidated weights (its head skipped) at lr 0, so both networks keep them; ``c.pt``."""
    root = tmp_path_factory.mktemp("runs")
    sharded = "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=true"
    run_on_ranks(_train_worker, 2, _tiny(root / "simclr", sharded))
    consolidate(str(root / "simclr"), str(root / "c.pt"))
    byol = _tiny(
        root / "byol",
        "config.OPTIMIZER.param_schedulers.lr.base_value=0",
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={root / 'c.pt'}",
        "config.MODEL.WEIGHTS_INIT.SKIP_LAYERS=[head.]",
        recipe="test/byol_tiny",
    )
    run_on_ranks(_train_worker, 1, byol)
    return root


def _trained(run_dir, recipe="test/simclr_tiny", prefix=""):
    """The run's model (its student, or with ``prefix="teacher."`` its teacher), in eval mode."""
    model = build_model(load_config(_tiny(run_dir, recipe=recipe)).MODEL).eval()
    load_pretrained(model, _weights_cfg(run_dir, REMOVE_PREFIX=prefix), only_prefix=prefix)
    return model


# --------------------------------------------------------------------------------------------
# the tiny runs: conversion, WEIGHTS_INIT with a teacher, exports and their cards


def test_conversion_to_torchvision_and_consolidated(runs, capsys):
    run = runs / "simclr"
    ckpt = find_latest_checkpoint(str(run))
    ours = _trained(run)
    export = to_torchvision(ckpt, str(runs / "tv.pt"))
    tv = torchvision.models.regnet.RegNet(
        block_params_from_config(load_config(_tiny(run)).MODEL.TRUNK.REGNET), stem_width=8
    )
    tv.fc = nn.Identity()
    tv.load_state_dict(torch.load(runs / "tv.pt", weights_only=True), strict=True)
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(tv.eval()(x), ours.trunk(x)["avgpool"], rtol=0, atol=1e-6)
    consolidated = consolidated_state_dict(ckpt)
    assert consolidated.keys() == ours.state_dict().keys()
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in consolidated.items())
    assert export.specs.keys() == {k[len("trunk.") :] for k in consolidated if k.startswith("trunk.")}
    main = runpy.run_path(str(TOOL))["main"]  # in this process
    capsys.readouterr()
    assert main([ckpt, "--inspect"]) == 0
    printed = capsys.readouterr().out
    assert "iteration 4, epoch 1" in printed and "written by 2 ranks" in printed
    out = subprocess.run(  # the real command
        [sys.executable, str(TOOL), ckpt, "--to-consolidated", str(runs / "c2.pt")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's vistrain, whichever is installed
    )
    assert out.returncode == 0, out.stderr
    written = torch.load(runs / "c2.pt", weights_only=True)
    assert all(torch.equal(written[k], v) for k, v in consolidated.items())


def test_weights_init_of_a_run_with_a_teacher_starts_both_networks_from_the_weights(runs):
    """BYOL from simclr's c.pt at lr 0: the student's trunk and the momentum teacher's (which
    starts as the student) hold c.pt's trunk after training."""
    given = torch.load(runs / "c.pt", weights_only=True)
    byol = consolidated_state_dict(str(runs / "byol"))
    trunk = [k for k, _ in _trained(runs / "simclr").trunk.named_parameters(prefix="trunk")]
    assert trunk and all(torch.equal(byol[k], given[k]) for k in trunk)
    for k in trunk:
        torch.testing.assert_close(byol[f"teacher.{k}"], given[k], rtol=1e-6, atol=1e-7)
    # the run's checkpoint (student and teacher.*) loads the student: its keys need no prefix
    model = build_model(load_config(_tiny("unused", recipe="test/byol_tiny")).MODEL)
    report = load_pretrained(model, _weights_cfg(runs / "byol"))
    assert (report.key_map.remove, report.key_map.append) == ("", "") and not report.missing
    assert report.unexpected and all(k.startswith("teacher.") for k in report.unexpected)


def _card_code(card: str) -> str:
    return card.split("```python\n")[1].split("```")[0]


def _load_with_card(card_path: Path, monkeypatch) -> nn.Module:
    """Run the card's lines in its folder (they name the file beside it); their ``model``."""
    monkeypatch.chdir(card_path.parent)
    scope = {}
    exec(_card_code(card_path.read_text()), scope)
    return scope["model"].eval()


def test_exports_load_with_their_cards_lines_and_the_cards_say_what_trained_them(
    runs, tmp_path, monkeypatch, capsys
):
    run, main = runs / "simclr", runpy.run_path(str(TOOL))["main"]
    (runs / "linear").mkdir()  # an evaluation of the run beside it, and an unrelated one
    record = {"engine": "linear_eval", "weights": str(run), "weights_from": "student"}
    (runs / "linear" / "metrics.json").write_text(
        json.dumps({**record, "results": {"avgpool": {"top1": 42.5}}})
    )
    (runs / "other").mkdir()
    (runs / "other" / "metrics.json").write_text(
        json.dumps({**record, "weights": "/elsewhere", "results": {}})
    )
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = _trained(run).trunk(x)["avgpool"]
    for flag, name in [("--to-torchvision", "trunk.pt"), ("--to-safetensors", "trunk.safetensors")]:
        capsys.readouterr()
        assert main([str(run), flag, str(tmp_path / name)]) == 0
        card = tmp_path / "trunk.README.md"
        assert f"to {tmp_path / name}; model card" in capsys.readouterr().out
        with torch.no_grad():
            torch.testing.assert_close(_load_with_card(card, monkeypatch)(x), expected, rtol=0, atol=1e-6)
        text = card.read_text()
        assert (
            "| method (`LOSS.NAME`) | simclr_loss |" in text and "| data (`DATA.TRAIN`) | synthetic |" in text
        )
        assert "| epochs | 1 of 1 |" in text and "iteration 4, epoch 1" in text
        assert "| linear | linear_eval | student | avgpool | 42.50 |" in text and "| other |" not in text
    # the momentum teacher's trunk, with an evaluation folder named on the command line
    assert main([str(runs / "byol"), "--to-safetensors", str(tmp_path / "t.safetensors"), "--teacher"]) == 0
    with torch.no_grad():
        teacher = _trained(runs / "byol", "test/byol_tiny", "teacher.").trunk(x)["avgpool"]
        torch.testing.assert_close(
            _load_with_card(tmp_path / "t.README.md", monkeypatch)(x), teacher, rtol=0, atol=1e-6
        )
    assert (
        main(
            [
                str(runs / "byol"),
                "--to-torchvision",
                str(tmp_path / "t.pt"),
                "--teacher",
                "--eval",
                str(runs / "linear"),
            ]
        )
        == 0
    )
    assert "| linear | linear_eval | student | avgpool | 42.50 |" in (tmp_path / "t.README.md").read_text()
    assert "| method (`LOSS.NAME`) | byol_loss |" in (tmp_path / "t.README.md").read_text()
    # one-line refusals
    for args, line in [
        ([str(run), "--to-torchvision", str(tmp_path / "x.pt"), "--teacher"],
         f"checkpoint error: {find_latest_checkpoint(str(run))}: holds no momentum teacher (LOSS.NAME simclr_loss "
         "trains none): export without --teacher"),
        ([str(run), "--to-timm", str(tmp_path / "x.pt")],
         "checkpoint error: a regnet trunk has no timm export: use --to-torchvision or --to-safetensors"),
        ([str(run), "--to-safetensors", str(tmp_path / "x.pt")],
         f"checkpoint error: {tmp_path / 'x.pt'}: a safetensors export's name ends in .safetensors"),
        ([str(run), "--inspect", "--teacher"],
         "input error: --teacher and --eval go with --to-torchvision, --to-timm or --to-safetensors"),
        ([str(run), "--to-torchvision", str(tmp_path / "x.pt"), "--eval", str(tmp_path)],
         f"input error: --eval {tmp_path}: holds no readable metrics.json (the run folder of a linear_eval, "
         "knn or finetune job)"),
    ]:  # fmt: skip
        capsys.readouterr()
        assert main(args) == 2 and capsys.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "x.pt").exists()


# --------------------------------------------------------------------------------------------
# weights in: other libraries' files and nestings, the key prefix found by matching


def _resnet18_ssl_model():
    """A vistrain model (trunk + SimCLR head) whose trunk is torchvision's resnet18 design."""
    cfg = load_config(
        [
            "config=test/simclr_resnet_tiny",
            "config.MODEL.TRUNK.RESNET.WIDTH_MULTIPLIER=1.0",
            "config.MODEL.TRUNK.RESNET.SMALL_STEM=False",
            "config.MODEL.HEAD.DIMS=[512,32,16]",
        ]
    )
    return build_model(cfg.MODEL).eval()


def test_library_state_dicts_load_under_any_nesting_with_the_prefix_found(tmp_path, one_thread):
    """torchvision's resnet18 state dict (its classifier ``fc`` included) into a vistrain ResNet
    (``trunk.``): bare, as DDP saved it under "model", as Lightning under "state_dict" with a
    ``backbone.``, under "model_state" beside other entries, and as a safetensors file."""
    from safetensors.torch import save_file

    tv = torchvision.models.resnet18()
    state = tv.state_dict()
    forms = {
        "bare.pt": (state, ("", "trunk.")),
        "ddp.pth": ({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, ("module.", "trunk.")),
        "lightning.ckpt": ({"state_dict": {f"backbone.{k}": v for k, v in state.items()}}, ("backbone.", "trunk.")),
        "nested.bin": ({"model_state": {f"model.encoder.{k}": v for k, v in state.items()}, "step": 7}, ("model.encoder.", "trunk.")),
    }  # fmt: skip
    for name, (obj, _) in forms.items():
        torch.save(obj, tmp_path / name)
    save_file(state, str(tmp_path / "trunk.safetensors"))
    forms["trunk.safetensors"] = (None, ("", "trunk."))
    tv.fc = nn.Identity()
    x = torch.randn(1, 3, 32, 32)
    model = _resnet18_ssl_model()
    with torch.no_grad():
        expected = tv.eval()(x)
        for name, (_, pair) in forms.items():
            for p in model.trunk.parameters():
                p.zero_()
            report = load_pretrained(model, _weights_cfg(tmp_path / name))
            assert (report.key_map.remove, report.key_map.append) == pair, name
            assert sorted(report.classifier) == ["trunk.fc.bias", "trunk.fc.weight"] and not report.unexpected
            assert report.missing and all(k.startswith("head.") for k in report.missing)
            torch.testing.assert_close(model.trunk(x)["avgpool"], expected, rtol=0, atol=1e-6)


def test_a_checkpoint_that_does_not_fit_is_one_line_naming_keys_and_the_fix(tmp_path, monkeypatch):
    state = torchvision.models.resnet18().state_dict()
    torch.save({k: v for k, v in state.items() if not k.startswith("layer4.")}, tmp_path / "cut.pt")
    torch.save({"student": state, "teacher": state}, tmp_path / "two.pt")
    torch.save(state, tmp_path / "r18.pt")
    regnet = build_model(load_config(["config=test/simclr_tiny"]).MODEL)
    cases = [
        (_resnet18_ssl_model(), "cut.pt",
         f"{tmp_path / 'cut.pt'} does not fit the model's trunk: missing trunk.layer4.0.conv1.weight, "
         "trunk.layer4.0.bn1.weight, trunk.layer4.0.bn1.bias, ... (30 in all); the checkpoint's unmatched keys none "
         "(mapped with REMOVE_PREFIX='', APPEND_PREFIX='trunk.' (found by matching the keys)); set "
         "MODEL.WEIGHTS_INIT.REMOVE_PREFIX / APPEND_PREFIX (or SKIP_LAYERS), or MODEL.TRUNK to the checkpoint's "
         "trunk (SKIP_LAYERS: trunk keys containing it stay at their initial values)"),
        (regnet, "r18.pt",
         f"{tmp_path / 'r18.pt'}: no key matches the model with REMOVE_PREFIX='', APPEND_PREFIX='' (found by "
         "matching the keys): checkpoint keys conv1.weight, bn1.weight, bn1.bias, ... (122 in all) map to "
         "conv1.weight, bn1.weight, bn1.bias; the model's keys are trunk.stem.0.weight, trunk.stem.1.weight, "
         "trunk.stem.1.bias, ... (71 in all); set MODEL.WEIGHTS_INIT.REMOVE_PREFIX / APPEND_PREFIX (or "
         "SKIP_LAYERS), or MODEL.TRUNK to the checkpoint's trunk"),
        (regnet, "two.pt",
         f"{tmp_path / 'two.pt'}: holds 2 state dicts (student, teacher), none under 'model' or 'state_dict': "
         "save the one to load by itself"),
    ]  # fmt: skip
    for model, name, line in cases:
        with pytest.raises(CheckpointError) as err:
            load_pretrained(model, _weights_cfg(tmp_path / name))
        assert str(err.value) == line
    monkeypatch.setitem(sys.modules, "safetensors", None)  # not installed
    (tmp_path / "w.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r'safetensors package: pip install -e "\.\[safetensors\]"$'):
        load_pretrained(regnet, _weights_cfg(tmp_path / "w.safetensors"))


# --------------------------------------------------------------------------------------------
# the timm and torchvision families: their own keys in, their library's form out


LIBRARY_TRUNKS = {  # family -> (overrides, the library model with a classifier, the feature it gives)
    "timm": (
        ["config.MODEL.TRUNK.NAME=timm", "config.MODEL.TRUNK.TIMM.NAME=test_vit",
         "config.MODEL.TRUNK.TIMM.KWARGS={img_size: 16, patch_size: 4}", "config.MODEL.TRUNK.OUT_FEATURES=[cls,avgpool]",
         "config.MODEL.HEAD.DIMS=[64,32,16]"],
        lambda: __import__("timm").create_model("test_vit", img_size=16, patch_size=4, num_classes=10),
        "cls",
    ),
    "torchvision": (
        ["config.MODEL.TRUNK.NAME=torchvision", "config.MODEL.TRUNK.TORCHVISION.NAME=mobilenet_v3_small",
         "config.MODEL.HEAD.DIMS=[1024,32,16]"],
        lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
        "avgpool",
    ),
}  # fmt: skip


def _headless(model: nn.Module) -> nn.Module:
    """A library model whose ``model(x)`` is its pooled feature (classifier's last layer dropped)."""
    from vistrain.models.trunks.torchvision_models import drop_classifier

    if hasattr(model, "reset_classifier"):  # timm
        model.reset_classifier(0)
    else:
        drop_classifier(model)
    return model.eval()


@pytest.mark.parametrize("family", list(LIBRARY_TRUNKS))
def test_library_trunks_take_their_librarys_keys_and_export_to_its_form(
    family, tmp_path, monkeypatch, one_thread
):
    """The library's own state dict (with a classifier) loads into the family's trunk with the
    prefix found; a run's checkpoint of it exports to a file the card's line loads back (then
    ``model(x)`` without the classifier's last layer is the trunk's feature)."""
    from vistrain.checkpoint import save_sharded_checkpoint

    overrides, library_model, feature = LIBRARY_TRUNKS[family]
    cfg = load_config(_tiny(tmp_path / "run", *overrides))
    ours = build_model(cfg.MODEL).eval()
    reference = library_model()
    torch.save(reference.state_dict(), tmp_path / "library.pt")
    report = load_pretrained(ours, _weights_cfg(tmp_path / "library.pt"))
    assert (report.key_map.remove, report.key_map.append) == ("", f"trunk.{family}.")
    assert len(report.classifier) == 2 and not report.unexpected
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = ours.trunk(x)[feature]
        torch.testing.assert_close(_headless(reference)(x), expected, rtol=0, atol=1e-6)
    save_sharded_checkpoint(str(tmp_path / "run"), 1, ours, None, {}, {"config": cfg.dump()}, keep_last=0)
    (tmp_path / "run" / "config.yaml").write_text(cfg.dump())
    main = runpy.run_path(str(TOOL))["main"]
    flag = "--to-timm" if family == "timm" else "--to-torchvision"
    for out in ("trunk.pt", "trunk.safetensors"):
        assert (
            main(
                [
                    str(tmp_path / "run"),
                    "--to-safetensors" if out.endswith("s") else flag,
                    str(tmp_path / out),
                ]
            )
            == 0
        )
        loaded = _load_with_card(tmp_path / "trunk.README.md", monkeypatch)
        assert f"'{out}'" in _card_code((tmp_path / "trunk.README.md").read_text())
        headless = _headless(loaded) if family == "timm" else loaded.eval()  # the card drops the layer
        with torch.no_grad():
            torch.testing.assert_close(headless(x), expected, rtol=0, atol=1e-6)
