"""Config loading: recipes, _BASE_ chains, typed overrides, and every bad-input message (also via the CLI)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vistrain.config import ConfigError, available_configs, save_config
from vistrain.config.loader import CONFIGS_DIR
from vistrain.methods import get_defaults, load_config

REPO = Path(__file__).resolve().parents[1]
ALL_CONFIGS = sorted(CONFIGS_DIR.rglob("*.yaml"))


def test_configs_folder_is_found_and_not_empty():
    assert CONFIGS_DIR == REPO / "configs"
    assert "test/simclr_tiny" in available_configs()


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS_DIR)))
def test_every_shipped_config_loads(path):
    name = str(path.relative_to(CONFIGS_DIR).with_suffix(""))
    cfg = load_config([f"config={name}"])
    assert cfg.is_frozen()
    assert load_config([f"config={path}"]) == cfg  # the same file given as a path


def test_defaults_without_config_name():
    assert load_config([]) == get_defaults()


def test_base_chain_and_overrides():
    cfg = load_config(["config=test/swav_tiny", "config.OPTIMIZER.num_epochs=5"])
    assert cfg.LOSS.NAME == "swav_loss"  # from swav_tiny
    assert cfg.MODEL.TRUNK.REGNET.DEPTH == 2  # from its _BASE_ simclr_tiny
    assert cfg.DATA.TRAIN.TRANSFORMS.NUM_CROPS == [2, 2]  # child overrides base
    assert cfg.OPTIMIZER.num_epochs == 5  # command line overrides both


def test_override_values_are_yaml_literals_checked_against_defaults():
    cfg = load_config(
        [
            "config.OPTIMIZER.weight_decay=0",  # int accepted for a float, stored as float
            "config.MODEL.HEAD.DIMS=[16, 8]",
            "config.DATA.TRAIN.TRANSFORMS.CROP_SCALES=[[0, 1]]",
            "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=true",
            "config.DISTRIBUTED.RUN_ID=10.0.0.1:29500",  # str keys take the text verbatim
            "config.CHECKPOINT.DIR=2024",
        ]
    )
    assert cfg.OPTIMIZER.weight_decay == 0.0 and isinstance(cfg.OPTIMIZER.weight_decay, float)
    assert cfg.MODEL.HEAD.DIMS == [16, 8]
    assert cfg.DATA.TRAIN.TRANSFORMS.CROP_SCALES == [[0.0, 1.0]]
    assert cfg.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN is True
    assert cfg.DISTRIBUTED.RUN_ID == "10.0.0.1:29500"
    assert cfg.CHECKPOINT.DIR == "2024"


def test_later_override_wins_and_position_of_config_name_does_not_matter():
    cfg = load_config(
        ["config.OPTIMIZER.num_epochs=3", "config=test/simclr_tiny", "config.OPTIMIZER.num_epochs=4"]
    )
    assert cfg.OPTIMIZER.num_epochs == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["config.OPTIMIZER.nmu_epochs=1"],
            "unknown config key OPTIMIZER.nmu_epochs; did you mean OPTIMIZER.num_epochs?",
        ),
        (["config.OPTIMZER.num_epochs=1"], "did you mean OPTIMIZER.num_epochs?"),
        (["config.DATA.TRAIN.BATCHSIZE=1"], "did you mean DATA.TRAIN.BATCHSIZE_PER_REPLICA?"),
        (["config.OPTIMIZER.zzzz=1"], "unknown config key OPTIMIZER.zzzz; valid keys in OPTIMIZER: betas,"),
        (
            ["config.ENGINE_NAME=knn"],
            "config key ENGINE_NAME is called JOB here (what a run does); set JOB=knn",
        ),
        (["config.OPTIMIZER.num_epochs=abc"], "config key OPTIMIZER.num_epochs expects int, got 'abc'"),
        (["config.OPTIMIZER.num_epochs=1.5"], "expects int, got '1.5'"),
        (["config.MODEL.HEAD.USE_BN=1"], "MODEL.HEAD.USE_BN expects bool, got '1'"),
        (["config.MODEL.HEAD.DIMS=[1, x]"], "MODEL.HEAD.DIMS expects a list of int, got '[1, x]'"),
        (["config.MODEL.HEAD.DIMS=[1"], "cannot parse value of MODEL.HEAD.DIMS"),
        (["config.OPTIMIZER=1"], "OPTIMIZER is a section, not a value"),
        (["config.OPTIMIZER.num_epochs"], "override config.OPTIMIZER.num_epochs has no value"),
        (["config=no_such_recipe"], "unknown config 'no_such_recipe'; available: "),
        (["config=/nowhere/x.yaml"], "config file not found: /nowhere/x.yaml"),
        (["config="], "config= needs a name"),
        (["config=test/simclr_tiny", "config=test/swav_tiny"], "config= given twice"),
        (["OPTIMIZER.num_epochs=1"], "argument 'OPTIMIZER.num_epochs=1' must start with config"),
        (["--config=x"], "must start with config"),
    ],
)
def test_bad_input_raises_one_line_config_error(argv, message):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_unknown_config_lists_available_names():
    with pytest.raises(ConfigError, match="test/simclr_tiny"):
        load_config(["config=nope"])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_unknown_key_in_yaml_names_file_and_closest_key(tmp_path):
    bad = _write(tmp_path / "bad.yaml", "OPTIMIZER:\n  nmu_epochs: 3\n")
    expected = r"bad.yaml: unknown config key OPTIMIZER.nmu_epochs; did you mean OPTIMIZER.num_epochs\?"
    with pytest.raises(ConfigError, match=expected):
        load_config([f"config={bad}"])


def test_unknown_key_in_a_base_file_names_the_base(tmp_path):
    _write(tmp_path / "base.yaml", "MODEL:\n  HAED:\n    NAME: swav\n")
    child = _write(tmp_path / "child.yaml", "_BASE_: base.yaml\nOPTIMIZER:\n  num_epochs: 3\n")
    expected = r"base.yaml: unknown config key MODEL.HAED.NAME; did you mean MODEL.HEAD.NAME\?"
    with pytest.raises(ConfigError, match=expected):
        load_config([f"config={child}"])


def test_wrong_type_in_yaml(tmp_path):
    bad = _write(tmp_path / "bad.yaml", "OPTIMIZER:\n  num_epochs: ten\n")
    with pytest.raises(ConfigError, match="bad.yaml: config key OPTIMIZER.num_epochs expects int, got 'ten'"):
        load_config([f"config={bad}"])


def test_yaml_errors(tmp_path):
    broken = _write(tmp_path / "broken.yaml", "OPTIMIZER: [\n")
    with pytest.raises(ConfigError, match="broken.yaml: invalid YAML"):
        load_config([f"config={broken}"])
    unsafe = _write(tmp_path / "unsafe.yaml", "SEED_VALUE: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match="invalid YAML"):  # safe_load semantics: no tags
        load_config([f"config={unsafe}"])
    listing = _write(tmp_path / "list.yaml", "- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config([f"config={listing}"])


def test_base_errors(tmp_path):
    missing = _write(tmp_path / "missing.yaml", "_BASE_: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="_BASE_ file not found: nowhere.yaml"):
        load_config([f"config={missing}"])
    _write(tmp_path / "a.yaml", "_BASE_: b.yaml\n")
    _write(tmp_path / "b.yaml", "_BASE_: a.yaml\n")
    with pytest.raises(ConfigError, match="_BASE_ chain is cyclic"):
        load_config([f"config={tmp_path / 'a.yaml'}"])


def test_list_of_bases_merge_in_order(tmp_path):
    _write(tmp_path / "one.yaml", "SEED_VALUE: 1\nLOG_FREQUENCY: 7\n")
    _write(tmp_path / "two.yaml", "SEED_VALUE: 2\n")
    child = _write(tmp_path / "child.yaml", "_BASE_: [one.yaml, two.yaml]\nOPTIMIZER: {num_epochs: 3}\n")
    cfg = load_config([f"config={child}"])
    assert (cfg.SEED_VALUE, cfg.LOG_FREQUENCY, cfg.OPTIMIZER.num_epochs) == (2, 7, 3)


def test_save_config_round_trips(tmp_path):
    cfg = load_config(["config=test/swav_tiny", "config.OPTIMIZER.weight_decay=0.5"])
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, str(path))
    assert load_config([f"config={path}"]) == cfg


def _cli(*argv):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_distributed.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["config.OPTIMIZER.nmu_epochs=1"], "did you mean OPTIMIZER.num_epochs?"),
        (["config.OPTIMIZER.num_epochs=abc"], "expects int, got 'abc'"),
        (["config=no_such_recipe"], "available: "),
        (["config.OPTIMIZER.num_epochs"], "has no value"),
        (["epochs=3"], "must start with config"),
    ],
)
def test_cli_bad_config_exits_2_with_one_line(argv, message):
    result = _cli(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_saved_config_of_another_version_is_refused(tmp_path):
    cfg = load_config(["config=test/swav_tiny"])
    path = tmp_path / "config.yaml"
    save_config(cfg, str(path))
    assert "VERSION: 1" in path.read_text()
    path.write_text(path.read_text().replace("VERSION: 1", "VERSION: 0"))
    with pytest.raises(ConfigError, match="written for config VERSION 0, this vistrain reads VERSION 1"):
        load_config([f"config={path}"])
    with pytest.raises(ConfigError, match="VERSION is set by vistrain"):
        load_config(["config.VERSION=2"])


def test_recipes_ship_with_a_plain_install(tmp_path):
    """``pip install .`` (not editable) must carry configs/ as vistrain.configs, found from any cwd."""
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    probe = (
        "from vistrain.config import load_config, available_configs; "
        "from vistrain.config.loader import CONFIGS_DIR; "
        "load_config(['config=regnet_fsdp']); print(CONFIGS_DIR); print(len(available_configs()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    where, count = result.stdout.split()
    assert Path(where) == target / "vistrain" / "configs"
    assert int(count) == len(available_configs())
