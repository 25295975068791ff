"""Every user mistake is one line on stderr and exit 2 (issue 25's table), found before the ranks
start where it can be (nothing written to the run folder), else by a rank (every rank stopped, the
run folder still resumable). A genuine crash of a rank keeps its traceback and exit 1
(tests/test_launcher.py)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vistrain import cli
from vistrain.checkpoint import find_latest_checkpoint
from vistrain.config import ConfigError, load_config
from vistrain.distributed.supervise import lock_run_folder
from vistrain.distributed.testing import run_on_ranks
from vistrain.training.trainer import train

REPO = Path(__file__).resolve().parents[1]
HANG = 600  # a healthy tiny run takes seconds; only a hung one reaches this


def _tiny(run_dir, *overrides):
    return ["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={run_dir}", *overrides]


def _image_folder(root: Path, per_class: int = 8) -> Path:
    """Two classes of ``per_class`` random 16 px PNGs: 16 images, two iterations of the tiny recipe."""
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def _refused_line(argv, capsys) -> str:
    """The one stderr line of a run refused before its ranks start (exit 2, no traceback)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


# --------------------------------------------------------------------------------------------
# checked before the ranks start: nothing written


def test_a_run_folder_that_cannot_be_created(capsys):
    line = _refused_line(_tiny("/proc/vistrain-x"), capsys)
    assert line.startswith(
        "config error: CHECKPOINT.DIR /proc/vistrain-x cannot be created: making a folder in /proc fails ("
    )
    assert not Path("/proc/vistrain-x").exists()


def test_the_lock_of_a_folder_that_cannot_be_created_is_a_one_line_config_error():
    """The launcher's own fallback, should the file system change after the check."""
    message = r"^CHECKPOINT.DIR /proc/vistrain-x cannot be used \(.*\); choose another CHECKPOINT.DIR$"
    with pytest.raises(ConfigError, match=message), lock_run_folder("/proc/vistrain-x"):
        pass


def test_fewer_samples_than_one_global_batch_under_drop_last(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = _tiny(run_dir, "config.DISTRIBUTED.NUM_PROC_PER_NODE=3", "config.DATA.TRAIN.DATA_LIMIT=8")
    assert _refused_line(argv, capsys) == (
        "config error: DATA.TRAIN has 8 samples, fewer than one global batch (3 ranks x "
        "BATCHSIZE_PER_REPLICA 4 = 12) with DROP_LAST; use DATA.TRAIN.BATCHSIZE_PER_REPLICA<=2 "
        "or DATA.TRAIN.DROP_LAST=False"
    )
    assert not run_dir.exists()


def test_an_image_folder_without_images(tmp_path, capsys):
    (tmp_path / "images" / "cat").mkdir(parents=True)
    run_dir = tmp_path / "run"
    argv = _tiny(
        run_dir,
        "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
        f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'images'}]",
    )
    line = _refused_line(argv, capsys)
    assert line.startswith("config error: DATA.TRAIN: disk_folder: no images (.jpg, ")
    assert line.endswith(f"under {tmp_path / 'images'}")
    assert not run_dir.exists()


def test_a_head_that_does_not_match_the_trunk(tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = _refused_line(_tiny(run_dir, "config.MODEL.HEAD.DIMS=[64,32,16]"), capsys)
    assert line == (
        "config error: MODEL.HEAD.DIMS[0] is 64 but the trunk's 'avgpool' feature has 16 channels; "
        "set MODEL.HEAD.DIMS[0]=16"
    )
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------
# found by a rank: every rank stopped, the run folder resumable


def _train(rank, world_size, argv):
    train(load_config(argv))


def test_an_unreadable_image_found_by_a_rank_names_skip_corrupt_and_keeps_the_checkpoint(tmp_path):
    images = _image_folder(tmp_path / "images")
    run_dir = tmp_path / "run"
    data = ["config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", f"config.DATA.TRAIN.DATA_PATHS=[{images}]"]
    run_on_ranks(_train, 2, _tiny(run_dir, *data, "config.OPTIMIZER.num_epochs=1"))
    good = find_latest_checkpoint(str(run_dir))
    assert good is not None
    (images / "b" / "5.png").write_bytes(b"not an image")  # read again by the next epoch

    command = [sys.executable, str(REPO / "tools" / "run_distributed.py"), *_tiny(run_dir, *data)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"data error: cannot read image {images / 'b' / '5.png'}: not an image format PIL knows; "
        "set DATA.TRAIN.SKIP_CORRUPT=True to skip unreadable images"
    ]
    assert find_latest_checkpoint(str(run_dir)) == good  # resumed from it, nothing replaced it
    assert not list(run_dir.glob("*.tmp"))
