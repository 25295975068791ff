"""One line per job, not per rank, under torchrun and srun (where every rank runs the command line):
a problem every rank finds is printed by global rank 0 alone; a problem one rank alone finds is
printed by that rank. (torchrun adds its own failure summary after ours; it is not vistrain's.)"""

import shlex
import sys
from pathlib import Path

import numpy as np
from job_processes import RUN, Job, job_env, slurm_env
from PIL import Image

from vistrain.checkpoint import find_latest_checkpoint
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config
from vistrain.training import train

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
BAD_NAME = "config error: OPTIMIZER.name must be one of adamw, lars, sgd; got 'adam'"


def _tiny(run_dir, *overrides):
    return ["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={run_dir}", *overrides]


def _ours(lines):
    """vistrain's one-line reports among a job's stderr lines (torchrun's own are not ours)."""
    kinds = ("config error:", "data error:", "checkpoint error:", "diverged:", "stopped:", "run folder busy:")
    return [line for line in lines if line.startswith(kinds)]


def test_torchrun_reports_a_config_error_of_every_rank_once(tmp_path):
    run_dir = tmp_path / "run"
    code, err, _ = Job(
        [*TORCHRUN, RUN, *_tiny(run_dir, "config.OPTIMIZER.name=adam")], run_dir, job_env()
    ).finish()
    assert code != 0
    assert _ours(err) == [BAD_NAME]
    assert not run_dir.exists()  # refused before anything was written


def test_srun_reports_a_config_error_of_every_rank_once(tmp_path):
    run_dir = tmp_path / "run"
    srun = [
        "srun",
        "--kill-on-bad-exit=1",
        sys.executable,
        RUN,
        *_tiny(run_dir, "config.OPTIMIZER.name=adam"),
    ]
    code, err, _ = Job(["bash", "-c", shlex.join(srun)], run_dir, slurm_env(tmp_path)).finish()
    assert code == 2 and err == [BAD_NAME]
    assert not run_dir.exists()


def _train(rank, world_size, argv):
    train(load_config(argv))


def test_torchrun_an_unreadable_image_one_rank_alone_reads_is_reported_once(tmp_path):
    """The next epoch reads the broken image on one rank only: that rank says so, once."""
    images = tmp_path / "images"
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (images / name).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                images / name / f"{i}.png"
            )
    run_dir = tmp_path / "run"
    data = ["config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", f"config.DATA.TRAIN.DATA_PATHS=[{images}]"]
    run_on_ranks(_train, 2, _tiny(run_dir, *data, "config.OPTIMIZER.num_epochs=1"))
    good = find_latest_checkpoint(str(run_dir))
    (images / "b" / "5.png").write_bytes(b"not an image")

    on = "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True"  # trains on from the 1-epoch run
    code, err, _ = Job([*TORCHRUN, RUN, *_tiny(run_dir, *data, on)], run_dir, job_env()).finish()
    assert code != 0
    assert _ours(err) == [
        f"data error: cannot read image {images / 'b' / '5.png'}: not an image format PIL knows; "
        "set DATA.TRAIN.SKIP_CORRUPT=True to skip unreadable images"
    ]
    assert find_latest_checkpoint(str(run_dir)) == good
    assert Path(good).is_dir()
