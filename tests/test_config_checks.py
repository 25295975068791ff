"""Every config value is checked before anything starts (vistrain.config.checks): a bad one exits 2
with one line naming the key, no traceback, and nothing written; --help and no arguments print
the usage."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vistrain import cli
from vistrain.config import ConfigError, available_configs
from vistrain.config.checks import RULES
from vistrain.jobs import catalog, check_values
from vistrain.methods import check_config, load_config

REPO = Path(__file__).resolve().parents[1]


def _refused(capsys, argv):
    """(exit code, stderr lines) of the CLI run in this process."""
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def _tiny(run_dir, *overrides):
    return ["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={run_dir}", *overrides]


def _bad_values(tmp_path):
    """(overrides, what the one line must say) for values that load (right key, right type) but
    can never run."""
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    truncated = tmp_path / "truncated.pt"
    torch.save({"w": torch.zeros(1000)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:300])
    knn = ["config.JOB=knn", "config.DATA.TRAIN.DROP_LAST=False"]
    return [
        (["config.OPTIMIZER.name=adam"], "OPTIMIZER.name must be one of adamw, lars, sgd; got 'adam'"),
        (
            ["config.MODEL.HEAD.NAME=mlp"],
            "MODEL.HEAD.NAME must be one of barlow_twins, byol, dino, identity, ijepa_predictor, lejepa, mae_decoder, moco_v3, msn, nnclr, simclr, simmim_decoder, simsiam, supervised, swav, vicreg",
        ),
        (["config.MODEL.TRUNK.REGNET.NAME=regnet_y_401mf"], "MODEL.TRUNK.REGNET.NAME must be one of"),
        (["config.DATA.TRAIN.DATA_SOURCES=[disk]"], "DATA.TRAIN.DATA_SOURCES must be a non-empty list of"),
        (
            ["config.MODEL.AMP_PARAMS.AMP_DTYPE=bf16"],
            "AMP_DTYPE must be one of bfloat16, float16; got 'bf16'",
        ),
        (["config.MODEL.AMP_PARAMS.INIT_SCALE=0.0"], "MODEL.AMP_PARAMS.INIT_SCALE must be > 0; got 0.0"),
        (
            ["config.MODEL.AMP_PARAMS.GROWTH_FACTOR=1.0"],
            "MODEL.AMP_PARAMS.GROWTH_FACTOR must be > 1; got 1.0",
        ),
        (
            ["config.MODEL.AMP_PARAMS.BACKOFF_FACTOR=1.0"],
            "MODEL.AMP_PARAMS.BACKOFF_FACTOR must be < 1; got 1.0",
        ),
        (
            ["config.MODEL.AMP_PARAMS.GROWTH_INTERVAL=0"],
            "MODEL.AMP_PARAMS.GROWTH_INTERVAL must be >= 1; got 0",
        ),
        (
            knn + ["config.BENCHMARK.FEATURES=[s9]"],
            "BENCHMARK.FEATURES must be a non-empty list of stem, s1, s2,",
        ),
        (
            knn + ["config.BENCHMARK.FEATURES=[s2, s1+s9]"],
            "BENCHMARK.FEATURES must be a non-empty list of stem, s1, s2,",
        ),
        (
            knn + ["config.BENCHMARK.FEATURES=[s2@0]"],
            "BENCHMARK.FEATURES must be a non-empty list of stem, s1, s2,",
        ),
        (
            knn + ["config.BENCHMARK.FEATURES=[s2@4+avgpool@2]"],
            "BENCHMARK.FEATURES must be a non-empty list of stem, s1, s2,",
        ),
        (
            knn + ["config.BENCHMARK.FEATURES=[s2@x]"],
            "BENCHMARK.FEATURES must be a non-empty list of stem, s1, s2,",
        ),
        (
            ["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=0"],
            "DATA.TRAIN.BATCHSIZE_PER_REPLICA must be >= 1; got 0",
        ),
        (["config.OPTIMIZER.num_epochs=0"], "OPTIMIZER.num_epochs must be >= 1; got 0"),
        (["config.OPTIMIZER.num_epochs=-1"], "OPTIMIZER.num_epochs must be >= 1; got -1"),
        (
            ["config.LOSS.simclr_loss.false_negative_prior=1.0"],
            "LOSS.simclr_loss.false_negative_prior must be < 1; got 1.0",
        ),
        (["config.LOSS.simclr_loss.hardness=-0.5"], "LOSS.simclr_loss.hardness must be >= 0; got -0.5"),
        (
            [
                "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path}/nope]",
            ],
            f"DATA.TRAIN.DATA_PATHS: disk_folder folder {tmp_path}/nope does not exist",
        ),
        (
            ["config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", f"config.DATA.TRAIN.DATA_PATHS=[{empty}]"],
            f"folder {empty} is empty",
        ),
        (
            ["config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]"],
            "disk_filelist needs a file; DATA_PATHS entry is empty",
        ),
        (["config.CHECKPOINT.DIR="], "CHECKPOINT.DIR is empty"),
        ([f"config.CHECKPOINT.DIR={a_file}/run"], f"{a_file} is a file"),
        (
            [f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={truncated}"],
            "truncated.pt: corrupt, truncated or unsafe",
        ),
        ([f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path}/none.pt"], "none.pt does not exist"),
        (
            ["config.MODEL.FSDP_CONFIG.BACKEND=fairscale"],
            "MODEL.FSDP_CONFIG.BACKEND must be one of builtin, torch",
        ),
        (["config.MACHINE.DEVICE=gpu"], "MACHINE.DEVICE must be one of auto, cpu, cuda"),
        (["config.MACHINE.CPU_MMAP_THRESHOLD_MIB=-1"], "MACHINE.CPU_MMAP_THRESHOLD_MIB must be >= 0; got -1"),
        (["config.BENCHMARK.LINEAR_LR_FOLDS=0"], "BENCHMARK.LINEAR_LR_FOLDS must be >= 1; got 0"),
        (
            ["config.OPTIMIZER.step_in_backward=True"],  # the tiny recipe runs under DDP
            "OPTIMIZER.step_in_backward needs the built-in sharded engine: set "
            "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        ),
        (
            [
                "config.OPTIMIZER.step_in_backward=True",
                "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                "config.MODEL.FSDP_CONFIG.BACKEND=torch",
            ],
            "OPTIMIZER.step_in_backward needs the built-in sharded engine",
        ),
        (
            [
                "config.OPTIMIZER.step_in_backward=True",
                "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                "config.OPTIMIZER.clip_grad_norm=1.0",
            ],
            "OPTIMIZER.step_in_backward cannot clip the global gradient norm",
        ),
    ]


def test_bad_values_exit_2_with_one_line_and_write_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for overrides, message in _bad_values(tmp_path):
        before = sorted(os.listdir(tmp_path))
        code, lines = _refused(capsys, _tiny(run_dir, *overrides))
        assert code == 2, overrides
        assert len(lines) == 1 and lines[0].startswith("config error: "), lines
        assert message in lines[0], (message, lines[0])
        assert sorted(os.listdir(tmp_path)) == before and not run_dir.exists()


def test_a_bad_value_is_refused_by_the_real_command_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_distributed.py"), *_tiny(tmp_path / "run")]
        + ["config.OPTIMIZER.name=adam", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: OPTIMIZER.name must be one of adamw, lars, sgd; got 'adam'"
    ]
    assert not (tmp_path / "run").exists()


# recipes for the user's own data: their paths are placeholders, so tests/test_real_data_recipes.py
# checks them with data written to disk
NEEDS_USER_DATA = {"pretrain/simclr_regnet_y_400mf_imagenet", "pretrain/swav_regnet_y_256gf_seer"}


# recipes on ELPV read the optional elpv-dataset package (`.[elpv]`, not in `.[dev]`); without it
# their check is the one line naming the install (tests/test_real_images.py runs them on a folder)
def _reads_elpv(cfg) -> bool:
    """The recipe reads ELPV where the elpv-dataset package put it (no DATA_PATHS of its own)."""
    return any(
        "elpv" in split.DATA_SOURCES and not any(split.DATA_PATHS)
        for split in (cfg.DATA.TRAIN, cfg.DATA.TEST)
    )


def test_every_shipped_config_passes_the_checks():
    elpv_installed = importlib.util.find_spec("elpv_dataset") is not None
    needs_elpv = set()
    for name in sorted(set(available_configs()) - NEEDS_USER_DATA):
        cfg = load_config([f"config={name}"])
        if _reads_elpv(cfg):
            needs_elpv.add(name)
        if name in needs_elpv and not elpv_installed:
            with pytest.raises(ConfigError, match=r"elpv-dataset package is not installed; pip install"):
                check_values(cfg)
        else:
            check_values(cfg)
    assert {
        "pretrain/simclr_regnet_elpv",
        "benchmark/linear_eval_elpv",
        "pretrain/mae_vit_elpv",
    } <= needs_elpv


def test_every_rule_names_an_existing_key():
    cfg = load_config([])
    for pattern in RULES:
        node = cfg
        for part in pattern.replace("*", "TRAIN").split("."):
            assert part in node, pattern
            node = node[part]


def test_registries_are_the_source_of_names():
    """A name added to a registry is accepted without touching the config layer."""
    from vistrain.optim import OPTIMIZERS

    cfg = load_config(["config.OPTIMIZER.name=novel"])
    with pytest.raises(ConfigError, match="OPTIMIZER.name must be one of"):
        check_values(cfg)
    OPTIMIZERS["novel"] = OPTIMIZERS["sgd"]
    try:
        check_values(cfg)
    finally:
        del OPTIMIZERS["novel"]


def test_typos_and_bad_plain_values_are_answered_without_importing_torch():
    """Keys, types and values that need no registry are checked before the registries load."""
    code = (
        "import sys; from vistrain import cli; "
        "code = cli.main(['config=regnet_fsdp', 'config.OPTIMIZER.num_epochs=0']); "
        "print(code, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "2 False"
    assert out.stderr.strip() == "config error: OPTIMIZER.num_epochs must be >= 1; got 0"


def test_the_catalog_is_built_only_when_a_rule_needs_it():
    def no_catalog():
        raise AssertionError("catalog built for a value that needs no registry")

    with pytest.raises(ConfigError, match="BATCHSIZE_PER_REPLICA must be >= 1"):
        check_config(load_config(["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=0"]), no_catalog)
    with pytest.raises(ConfigError, match="OPTIMIZER.name must be one of adamw, lars, sgd"):
        check_config(load_config(["config.OPTIMIZER.name=adam"]), catalog)


def test_help_and_no_arguments_print_the_usage(capsys):
    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: python tools/run_distributed.py config=NAME [config.SECTION.KEY=VALUE")
    assert "regnet_fsdp" in usage and "pretrain/swav_regnet_demo" in usage
    assert "vistrain/config/defaults.py" in usage and len(usage.splitlines()) < 15
    assert cli.main([]) == 2
    assert capsys.readouterr().err == usage


def test_float16_runs_on_any_device():
    """fp16 autocast and loss scaling work on CPU ranks too (tests/test_training_corners.py)."""
    for device in ("cpu", "auto"):
        fp16 = ["config.MODEL.AMP_PARAMS.USE_AMP=True", "config.MODEL.AMP_PARAMS.AMP_DTYPE=float16"]
        check_config(
            load_config(["config=test/simclr_tiny", f"config.MACHINE.DEVICE={device}", *fp16]), catalog()
        )


def test_the_step_in_backward_refuses_fp16_loss_scaling():
    """float16 needs a grad scaler, which skips a step only once every gradient is in."""
    cfg = load_config(
        [
            "config=test/simclr_tiny",
            "config.MACHINE.DEVICE=auto",
            "config.OPTIMIZER.step_in_backward=True",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
            "config.MODEL.AMP_PARAMS.USE_AMP=True",
            "config.MODEL.AMP_PARAMS.AMP_DTYPE=float16",
        ]
    )
    with pytest.raises(ConfigError, match="cannot skip a step on an fp16 overflow .*AMP_DTYPE=bfloat16"):
        check_config(cfg, catalog())
    cfg.defrost()
    cfg.MODEL.AMP_PARAMS.AMP_DTYPE = "bfloat16"
    check_config(cfg, catalog())
