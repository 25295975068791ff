"""Every user mistake is one line on stderr and exit 2 (issue 25's table), found before the ranks
start where it can be (nothing written to the run folder), else by a rank (every rank stopped, the
run folder still resumable). A genuine crash of a rank keeps its traceback and exit 1
(tests/test_launcher.py)."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vistrain import cli
from vistrain.checkpoint import find_latest_checkpoint
from vistrain.config import ConfigError
from vistrain.distributed.supervise import lock_run_folder
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config
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

    train_on = "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True"  # epoch 2 of 2 after a 1-epoch run
    command = [sys.executable, str(REPO / "tools" / "run_distributed.py"), *_tiny(run_dir, *data, train_on)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"data error: cannot read image {images / 'b' / '5.png'}: not an image format PIL knows; "
        "set DATA.TRAIN.SKIP_CORRUPT=True to skip unreadable images"
    ]
    assert find_latest_checkpoint(str(run_dir)) == good  # resumed from it, nothing replaced it
    assert not list(run_dir.glob("*.tmp"))


# --------------------------------------------------------------------------------------------
# numbers as people write them


@pytest.mark.parametrize("text, value", [("3e-4", 3e-4), ("1e8", 1e8), ("1.0e8", 1e8), ("-2E-3", -2e-3)])
def test_a_float_key_takes_exponent_notation_on_the_command_line_and_in_recipes(tmp_path, text, value):
    key = "OPTIMIZER.param_schedulers.lr.base_value"
    assert load_config([f"config.{key}={text}"]).OPTIMIZER.param_schedulers.lr.base_value == value
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"_BASE_: {REPO / 'configs' / 'test' / 'simclr_tiny.yaml'}\n")
    recipe.write_text(recipe.read_text() + f"OPTIMIZER:\n  weight_decay: {text}\n")
    cfg = load_config([f"config={recipe}"])
    assert cfg.OPTIMIZER.weight_decay == value and isinstance(cfg.OPTIMIZER.weight_decay, float)


def test_an_int_key_given_an_exponent_is_one_line_naming_the_integer(capsys):
    assert _refused_line(["config=test/simclr_tiny", "config.OPTIMIZER.num_epochs=1e3"], capsys) == (
        "config error: config key OPTIMIZER.num_epochs expects int, got '1e3'; write it as an integer: 1000"
    )


def test_counted_nouns_agree_with_their_count(tmp_path, caplog):
    """ "1 epoch", "1 corrupt image": the issue's "1 epochs", "1 corrupt images" (also the closing
    line of a run that skipped one image)."""
    from vistrain.config.words import plural
    from vistrain.runtime.logger import TrainingMeter

    assert [plural(1, "epoch"), plural(2, "epoch"), plural(0, "rank")] == ["1 epoch", "2 epochs", "0 ranks"]
    assert plural(1.5, "epoch") == "1.5 epochs" and plural(1234, "image") == "1,234 images"
    meter = TrainingMeter(str(tmp_path), 1, 1, torch.device("cpu"))
    meter.update(torch.tensor(1.0), num_images=4, num_skipped=1)
    meter.log(1, 0, 1, 0.1)
    with caplog.at_level("INFO", logger="vistrain"):
        meter.summary()
    assert caplog.messages[-1].endswith("img/s overall, skipped 1 corrupt image")


# --------------------------------------------------------------------------------------------
# image folders with links


def _scan_with_warnings(rank, world_size, root):
    import logging

    from vistrain.data.datasets import scan_image_folder

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vistrain").addHandler(handler)
    paths, labels, _ = scan_image_folder(root)
    return paths, labels, [r.getMessage() for r in records if r.levelname == "WARNING"]


def test_a_symlink_loop_and_a_repeated_link_are_walked_once_with_one_warning(tmp_path):
    images = _image_folder(tmp_path / "images", per_class=3)
    (images / "a" / "loop").symlink_to(".")  # the cls/loop -> .
    (images / "b" / "again").symlink_to(images / "a")  # a folder already read, through another class
    (images / "b" / "deeper").mkdir()
    (images / "b" / "deeper" / "up").symlink_to("..")  # a loop one level further down
    (paths, labels, warnings), (_, _, warnings_rank1) = run_on_ranks(_scan_with_warnings, 2, str(images))
    assert len(paths) == 6 and labels == [0, 0, 0, 1, 1, 1]
    assert len({os.path.realpath(p) for p in paths}) == 6
    assert len(warnings) == 1 and warnings_rank1 == []  # rank 0 says it once
    assert warnings[0].startswith(f"disk_folder: skipped 3 linked folders under {images} already read")


# --------------------------------------------------------------------------------------------
# the tools say what the launcher says


def _tool(name, *args):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG,
    )


def _convert_in_process(capsys, *args):
    """tools/convert_checkpoint.py's main() in this process: (exit code, stderr lines)."""
    capsys.readouterr()
    code = runpy.run_path(str(REPO / "tools" / "convert_checkpoint.py"))["main"](list(args))
    return code, capsys.readouterr().err.splitlines()


def test_plan_memory_and_convert_checkpoint_give_the_launchers_one_line_errors(tmp_path, capsys):
    """Each tool once as a real command (exit 2, one stderr line); convert_checkpoint's other
    mistakes through the same main() in this process (no torch start-up per case)."""
    head = ["config=test/simclr_tiny", "config.MODEL.HEAD.DIMS=[64,32,16]"]
    launcher_line = _refused_line([*head, f"config.CHECKPOINT.DIR={tmp_path / 'run'}"], capsys)
    done = _tool("plan_memory.py", *head)
    assert done.returncode == 2 and done.stderr.splitlines() == [launcher_line]
    done = _tool("convert_checkpoint.py", str(tmp_path / "missing"), "--inspect")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"checkpoint error: {tmp_path / 'missing'}: no such file or folder"]
    code, err = _convert_in_process(capsys, str(tmp_path), "--inspect")
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"checkpoint error: {tmp_path}: holds no complete checkpoint")
    # a file that is no checkpoint at all, or one holding code: words, not "KeyError: 101" or
    # torch's advice to load with weights_only=False
    (tmp_path / "notes.pt").write_text("hello\n")
    torch.save({"layer": torch.nn.Linear(1, 1)}, tmp_path / "module.pt")
    for name, why in [
        ("notes.pt", "not a whole zip archive as torch.save writes, nor a legacy file of plain tensors"),
        ("module.pt", "it holds objects other than tensors and plain containers; loading never runs code"),
    ]:
        assert _convert_in_process(capsys, str(tmp_path / name), "--inspect") == (
            2,
            [f"checkpoint error: {tmp_path / name}: corrupt, truncated or unsafe checkpoint file ({why})"],
        )
    # an output that cannot be written names its folder (it said "/proc/x.pt.tmp: no such file")
    torch.save({"trunk.w": torch.zeros(2)}, tmp_path / "small.pt")
    for out, why in [
        ("/proc/x.pt", "making a file in /proc fails (No such file or directory); choose another path"),
        (
            f"{tmp_path}/none/x.pt",
            f"its folder {tmp_path}/none does not exist; create it or choose another path",
        ),
    ]:
        assert _convert_in_process(capsys, str(tmp_path / "small.pt"), "--to-consolidated", out) == (
            2,
            [f"input error: cannot write {out}: {why}"],
        )


# --------------------------------------------------------------------------------------------
# a run that diverges, and what a run says while it starts


def test_divergence_is_one_line_exit_3_keeping_the_last_good_checkpoint(tmp_path):
    """lr 1e8: NaN within the first epoch; checkpoint_2 (saved before) is kept and named. The same
    (auto-tuned) run shows what the command says first: what it is doing, the auto-tuner's choice in
    one short line (its details in log.txt), plurals that agree."""
    run_dir = tmp_path / "run"
    argv = _tiny(
        run_dir,
        "config.OPTIMIZER.param_schedulers.lr.base_value=1e8",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
        "config.LOG_FREQUENCY=1",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.FSDP_CONFIG.AUTO_TUNE=True",
    )
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_distributed.py"), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 3, done.stderr
    (line,) = done.stderr.splitlines()
    kept = find_latest_checkpoint(str(run_dir))
    assert kept == str(run_dir / "checkpoint_2")
    assert re.fullmatch(
        r"diverged: loss became (nan|inf) by iteration \d+; last good checkpoint "
        + re.escape(kept)
        + r" kept; lower OPTIMIZER\.param_schedulers\.lr\.base_value, set OPTIMIZER\.clip_grad_norm or "
        r"check the data, then rerun",
        line,
    )
    out = done.stdout.splitlines()
    assert out[0].endswith(
        f"vistrain] checking the config, its data and CHECKPOINT.DIR {run_dir} (loading torch)"
    )
    (tuned,) = [text for text in out if "auto-tune:" in text]
    assert len(tuned) < 200 and tuned.endswith("(details in log.txt)")
    assert "auto-tune: chose " in (run_dir / "log.txt").read_text()  # the full line
    assert any(
        text.endswith("training 2 epochs x 4 iterations on 2 ranks (cpu), from iteration 0") for text in out
    )


_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # importing torch now fails: what is printed before needs none
from vistrain import cli
try:
    cli.main(sys.argv[1:])
except ImportError:
    sys.exit(7)
"""


def test_the_first_line_comes_before_torch_is_loaded(tmp_path):
    """The command's first line needs no torch (which takes seconds to import): it comes at once."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, *_tiny(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout.splitlines()[0].endswith(
        "vistrain] checking the config, its data and CHECKPOINT.DIR "
        + str(tmp_path / "run")
        + " (loading torch)"
    )
