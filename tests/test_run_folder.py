"""Run folders nothing can corrupt: one run per folder, ranks that die with their launcher, Ctrl-C
in one line, checkpoints ranked by training progress (unreadable ones set aside, never
overwritten), config.yaml recorded only by runs that train.

The process tests start ``tests/run_folder_job.py``: a real launcher (``vistrain.cli.run``) with 2
spawned CPU ranks that loop on collectives.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from torch import nn

from vistrain import cli
from vistrain.checkpoint import find_latest_checkpoint, read_metadata, save_sharded_checkpoint
from vistrain.checkpoint.files import prune
from vistrain.config.loader import load_yaml
from vistrain.distributed.supervise import LOCK_NAME, RunFolderBusyError, lock_run_folder
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config
from vistrain.training.resume import pick_checkpoint
from vistrain.training.trainer import train

HERE = Path(__file__).resolve()
JOB = HERE.parent / "run_folder_job.py"  # a real launcher with 2 ranks looping on collectives
# Upper bound on processes stopping (they stop in about a second): a hang fails, a loaded machine does not.
STOP_LIMIT = 120


def _tiny(run_dir, *overrides):
    return ["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={run_dir}", *overrides]


# --------------------------------------------------------------------------------------------
# one run per folder


def test_a_second_run_into_a_locked_folder_exits_2_naming_the_holder(tmp_path, capsys):
    with lock_run_folder(str(tmp_path)):
        # a separate open file in the same process: flock refuses it too
        with pytest.raises(RunFolderBusyError), lock_run_folder(str(tmp_path)):
            pass
        assert cli.main(_tiny(tmp_path)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"run folder busy: {tmp_path} is in use by another run (host ")
    assert f"host {socket.gethostname()}, pid {os.getpid()}, since 20" in lines[0]
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # the refused run wrote nothing
    with lock_run_folder(str(tmp_path)):  # released when the holder left its block
        pass


def _start_job(run_dir: Path):
    """The launcher as its own process group (like a shell job); returns it once both ranks loop."""
    proc = subprocess.Popen(
        [sys.executable, str(JOB), str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    while not all((run_dir / f"ready{r}").exists() for r in (0, 1)):  # both ranks in their loop
        assert proc.poll() is None, "ranks did not start"
        time.sleep(0.1)
    return proc, [int((run_dir / f"pid{r}").read_text()) for r in (0, 1)]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_ranks_die_with_a_sigkilled_launcher_and_the_lock_is_released(tmp_path):
    proc, ranks = _start_job(tmp_path)
    try:
        with (
            pytest.raises(RunFolderBusyError, match=f"pid {proc.pid}, since"),
            lock_run_folder(str(tmp_path)),
        ):
            pass
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _wait_gone(ranks, seconds=STOP_LIMIT), "ranks outlived their launcher"
        with lock_run_folder(str(tmp_path)):  # the kernel dropped the dead launcher's flock
            pass
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_forked_child_does_not_keep_the_run_folder_locked(tmp_path):
    """A forked CPU rank or DataLoader worker shares the lock's open file: it closes its copy, so
    the lock ends with its holder, not with the last child."""
    started, tell = os.pipe()
    with lock_run_folder(str(tmp_path)):
        child = os.fork()
        if child == 0:  # the fork handlers have run once the child runs its own code
            os.write(tell, b"1")
            time.sleep(30)
            os._exit(0)
        os.read(started, 1)
    try:
        with lock_run_folder(str(tmp_path)):  # the holder let go; its child is still alive
            assert _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(started)
        os.close(tell)


# A rank bound to its parent on a system without PR_SET_PDEATHSIG: only the parent-pid check acts.
# (supervise.py is loaded from its file: the package's __init__ would import torch, which is slow.)
_NO_PDEATHSIG_RANK = """
import importlib.util, os, sys, time
sys.platform = "other"  # not linux: bind_to_launcher skips prctl
spec = importlib.util.spec_from_file_location("supervise", sys.argv[1])
supervise = importlib.util.module_from_spec(spec)
spec.loader.exec_module(supervise)
supervise.bind_to_launcher(os.getppid())
print(os.getpid(), flush=True)
time.sleep(2 * supervise.PARENT_POLL_SECONDS)
print("running after two parent checks", flush=True)
time.sleep(3600)  # far beyond STOP_LIMIT: only the parent check ends it in time
"""
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
time.sleep(120)
"""


def test_without_pdeathsig_the_parent_pid_check_ends_an_orphaned_rank():
    supervise_file = str(HERE.parents[1] / "vistrain" / "distributed" / "supervise.py")
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _NO_PDEATHSIG_RANK, supervise_file], stdout=subprocess.PIPE, text=True
    )
    rank = int(parent.stdout.readline())
    try:
        # bound, parent alive: keeps running past its parent checks
        assert parent.stdout.readline() == "running after two parent checks\n"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _wait_gone([rank], seconds=STOP_LIMIT)  # re-parented: its check (every 1 s) ends it
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


def _plain_checkpoint(run_dir, iteration, samples_seen, keep_last=0):
    model = nn.Linear(3, 2)
    meta = {"epoch": 0, "samples_seen": samples_seen}
    return save_sharded_checkpoint(str(run_dir), iteration, model, None, {}, meta, keep_last)


def test_ctrl_c_stops_every_rank_and_names_the_last_checkpoint_in_one_line(tmp_path):
    _plain_checkpoint(tmp_path, 3, samples_seen=96)
    proc, ranks = _start_job(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    out, err = proc.communicate(timeout=STOP_LIMIT)
    assert proc.returncode == 130
    assert err.strip().splitlines() == [
        f"interrupted: all ranks stopped; last complete checkpoint: {tmp_path / 'checkpoint_3'}"
    ]
    assert "Traceback" not in out + err and "terminate called" not in out + err
    assert _wait_gone(ranks, seconds=STOP_LIMIT)


# --------------------------------------------------------------------------------------------
# checkpoints ranked by progress


def test_latest_and_pruning_follow_samples_seen_not_iteration_numbers(tmp_path):
    """The issue's case: 2 ranks save 22 (epoch 1) and 44 (epoch 2), 3 ranks then save 21 (epoch 3)."""
    epoch = 352  # samples per epoch
    _plain_checkpoint(tmp_path, 22, samples_seen=epoch)
    _plain_checkpoint(tmp_path, 44, samples_seen=2 * epoch)
    _plain_checkpoint(tmp_path, 21, samples_seen=3 * epoch)
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint_21")
    prune(str(tmp_path), keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == ["checkpoint_21", "checkpoint_44"]


@pytest.mark.parametrize("damage", ["truncated metadata", "corrupt rank file", "missing rank file"])
def test_an_unreadable_checkpoint_is_reported_and_set_aside(tmp_path, damage, caplog):
    _plain_checkpoint(tmp_path, 4, samples_seen=32)
    bad = Path(_plain_checkpoint(tmp_path, 8, samples_seen=64))
    if damage == "truncated metadata":
        text = (bad / "metadata.json").read_text()
        (bad / "metadata.json").write_text(text[: len(text) // 2])
    elif damage == "corrupt rank file":
        (bad / "rank0.pt").write_bytes((bad / "rank0.pt").read_bytes()[:100])
    else:
        (bad / "rank0.pt").unlink()
    unreadable = []
    assert find_latest_checkpoint(str(tmp_path), unreadable) == str(tmp_path / "checkpoint_4")
    assert [path for path, _ in unreadable] == [str(bad)]
    with caplog.at_level("WARNING", logger="vistrain"):
        assert pick_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint_4")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("skipping unreadable checkpoint: ")
    assert warnings[0].endswith(f"kept as {bad}.corrupt")
    assert not bad.exists() and Path(f"{bad}.corrupt").is_dir()  # a save of checkpoint_8 can't touch it
    prune(str(tmp_path), keep_last=1)
    assert Path(f"{bad}.corrupt").is_dir()  # pruning leaves it alone too


def _train(rank, world_size, argv):
    train(load_config(argv))


def test_world_size_changes_resume_from_the_most_advanced_and_record_each_config(tmp_path):
    """1 rank x 2 epochs (8 iterations each: checkpoints 8, 16), then 2 ranks to epoch 3 (4 per
    epoch: checkpoint 12, less numbered but more advanced), then a rerun asking for 3 epochs."""
    run_on_ranks(_train, 1, _tiny(tmp_path, "config.OPTIMIZER.num_epochs=2"))
    first_config = (tmp_path / "config.yaml").read_text()
    train_on = "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True"  # 3 epochs from a 2-epoch run's checkpoint
    run_on_ranks(_train, 2, _tiny(tmp_path, "config.OPTIMIZER.num_epochs=3", train_on))
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == ["checkpoint_12", "checkpoint_16"]
    latest = find_latest_checkpoint(str(tmp_path))
    assert latest == str(tmp_path / "checkpoint_12")
    assert read_metadata(latest)["samples_seen"] == 3 * 32 and read_metadata(latest)["epoch"] == 3
    log = (tmp_path / "log.txt").read_text()
    assert f"resumed from {tmp_path / 'checkpoint_16'} at iteration 8" in log
    # the first run's config trained everything up to checkpoint_16
    assert (tmp_path / "config.16.yaml").read_text() == first_config
    second_config = (tmp_path / "config.yaml").read_text()
    assert "num_epochs: 3" in second_config

    # nothing to do: says epochs, and leaves the record alone even with other settings
    run_on_ranks(_train, 2, _tiny(tmp_path, "config.OPTIMIZER.num_epochs=3", "config.LOG_FREQUENCY=1"))
    assert "nothing to do: " in (tmp_path / "log.txt").read_text()
    assert "already holds 3 epochs of the 3 asked for" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "config.yaml").read_text() == second_config
    assert sorted(p.name for p in tmp_path.glob("config*.yaml")) == ["config.16.yaml", "config.yaml"]


def test_checkpoints_set_aside_as_unreadable_are_pruned_beyond_the_newest_few(tmp_path):
    from vistrain.checkpoint.files import KEEP_CORRUPT

    _plain_checkpoint(tmp_path, 2, samples_seen=16)
    rounds = KEEP_CORRUPT + 3
    for n in range(rounds):  # every resumed run meets an unreadable checkpoint_4 (and then saves)
        bad = Path(_plain_checkpoint(tmp_path, 4, samples_seen=32))
        (bad / "rank0.pt").write_bytes(b"truncated")
        (bad / "round").write_text(str(n))
        assert pick_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint_2")
        time.sleep(0.02)  # distinct rename times
    _plain_checkpoint(tmp_path, 6, samples_seen=48)  # every save prunes
    kept = sorted(int((p / "round").read_text()) for p in tmp_path.glob("checkpoint_4.corrupt*"))
    assert kept == list(range(rounds - KEEP_CORRUPT, rounds))  # the most recently set aside
    assert {p.name for p in tmp_path.glob("checkpoint_*") if "corrupt" not in p.name} == {
        "checkpoint_2",
        "checkpoint_6",
    }


# --------------------------------------------------------------------------------------------
# a run folder remembers what it trains


def _recorded_run(run_dir, *overrides, samples=32):
    """A complete checkpoint of the tiny recipe (with ``overrides``) as a run on ``samples``
    training images saves it: its config and data size in metadata.json."""
    cfg = load_config(_tiny(run_dir, *overrides))
    meta = {
        "epoch": 1,
        "samples_seen": samples,
        "num_samples": samples,
        "config": cfg.dump(),
        "world_size": 2,
    }
    return save_sharded_checkpoint(str(run_dir), 4, nn.Linear(3, 2), None, {}, meta, 0)


def _folder_state(run_dir):
    return sorted((str(p.relative_to(run_dir)), p.stat().st_mtime_ns) for p in Path(run_dir).rglob("*"))


@pytest.mark.parametrize(
    "other, said",
    [
        (
            ["config.DATA.TRAIN.SYNTHETIC_SIZE=40"],
            "holds checkpoints of data synthetic (train, 32 samples); this run trains data synthetic "
            "(train, 40 samples)",
        ),
        (
            ["config.LOSS.NAME=swav_loss", "config.MODEL.HEAD.NAME=swav"],
            "holds checkpoints of method simclr_loss, head {NAME: simclr}; this run trains method "
            "swav_loss, head {NAME: swav}",
        ),
        (
            ["config.MODEL.TRUNK.REGNET.SE_RATIO=0.0"],
            "holds checkpoints of trunk regnet {SE_RATIO: 0.25}; this run trains trunk regnet {SE_RATIO: 0.0}",
        ),
    ],
)
def test_another_run_into_a_folder_is_one_line_exit_2_naming_a_free_folder(tmp_path, capsys, other, said):
    """The README's own-images command after the quick start: other data (here: another size),
    another method or trunk in the same folder. Refused before any rank starts, nothing touched."""
    run_dir = tmp_path / "run"
    _recorded_run(run_dir)
    (tmp_path / "run_2").mkdir()  # taken: the line names the next free name
    before = _folder_state(run_dir)
    assert cli.main(_tiny(run_dir, *other)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0] == (
        f"run folder taken: {run_dir} {said}; resuming would mix the two and a fresh start would "
        f"overwrite them: give this run its own folder, e.g. config.CHECKPOINT.DIR={tmp_path / 'run_3'}"
    )
    assert _folder_state(run_dir) == before
    # a fresh start (AUTO_RESUME off) would overwrite its checkpoints: refused alike
    assert cli.main(_tiny(run_dir, *other, "config.CHECKPOINT.AUTO_RESUME=False")) == 2
    assert "run folder taken: " in capsys.readouterr().err


def test_what_may_change_on_resume_passes_the_folder_check(tmp_path):
    """Ranks (with the same global batch), exact knobs, precision, logging, checkpoint settings:
    the same run and schedule."""
    from vistrain.jobs import check_run_folder

    _recorded_run(tmp_path)
    check_run_folder(load_config(_tiny(tmp_path)), 32)
    check_run_folder(
        load_config(
            _tiny(
                tmp_path,
                "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
                "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",  # 2 ranks x 4 saved it
                "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                "config.OPTIMIZER.step_in_backward=True",
                "config.MODEL.AMP_PARAMS.USE_AMP=True",
                "config.LOG_FREQUENCY=1",
                "config.CHECKPOINT.KEEP_LAST=5",
            )
        ),
        32,
    )


def test_another_schedule_in_a_folder_is_one_line_exit_2_unless_training_on(tmp_path, capsys):
    """README's first try (1 epoch here: 2) then the recipe (40) in the same folder: resuming would
    train neither schedule. Refused before any rank starts, one line naming a free folder;
    with ALLOW_OTHER_SCHEDULE it trains on."""
    from vistrain.jobs import check_run_folder

    run_dir = tmp_path / "run"
    _recorded_run(run_dir)
    before = _folder_state(run_dir)
    assert cli.main(_tiny(run_dir, "config.OPTIMIZER.num_epochs=40")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"run folder taken: {run_dir} holds checkpoints trained with OPTIMIZER.num_epochs 2; this run asks "
        "for OPTIMIZER.num_epochs 40: resuming would continue that run under another schedule and a fresh "
        f"start would overwrite it: give this run its own folder, e.g. config.CHECKPOINT.DIR={tmp_path / 'run_2'} "
        "(or train on from it: config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True)"
    ]
    assert _folder_state(run_dir) == before
    train_on = "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True"
    check_run_folder(load_config(_tiny(run_dir, "config.OPTIMIZER.num_epochs=40", train_on)), 32)


@pytest.mark.parametrize(
    "other, said",
    [
        (
            [
                "config.OPTIMIZER.param_schedulers.lr.base_value=0.3",
                "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
            ],
            "OPTIMIZER.param_schedulers.lr.base_value 0.05, global batch 8 (2 ranks x 4); this run asks "
            "for OPTIMIZER.param_schedulers.lr.base_value 0.3, global batch 16 (2 ranks x 8):",
        ),
        (["config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0.2"], "lr.warmup_epochs 0.5; this run asks"),
        (
            ["config.DATA.TRAIN.TRANSFORMS.BLUR_PROB=0.0"],
            "DATA.TRAIN.TRANSFORMS.BLUR_PROB 0.5; this run asks",
        ),
        (["config.LOSS.simclr_loss.temperature=0.5"], "LOSS.simclr_loss.temperature 0.1; this run asks"),
        (["config.SEED_VALUE=1"], "SEED_VALUE 0; this run asks for SEED_VALUE 1:"),
    ],
)
def test_the_schedule_a_folder_remembers(tmp_path, other, said):
    """The lr and batch, the warm-up, the augmentations, the method's settings, the seed."""
    from vistrain.checkpoint.identity import OtherRunError
    from vistrain.jobs import check_run_folder

    _recorded_run(tmp_path)
    with pytest.raises(OtherRunError, match="holds checkpoints trained with ") as refused:
        check_run_folder(load_config(_tiny(tmp_path, *other)), 32)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_an_evaluation_over_another_ones_results_is_one_line_exit_2(tmp_path, capsys):
    """A 10% linear evaluation in the folder of the full-label one, a kNN or a pretraining run
    there: refused, one line naming a free folder. The same evaluation (on other ranks, other
    logging) runs again there."""
    from vistrain.checkpoint.identity import OtherRunError
    from vistrain.jobs import check_run_folder

    run_dir = tmp_path / "eval"
    evaluation = ["config=test/benchmark_tiny", f"config.CHECKPOINT.DIR={run_dir}"]
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(load_config(evaluation).dump())  # what its run recorded
    assert cli.main([*evaluation, "config.DATA.TRAIN.LABEL_FRACTION=0.5"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"run folder taken: {run_dir} holds the results of another linear_eval job "
        "(DATA.TRAIN.LABEL_FRACTION 1.0; this run: DATA.TRAIN.LABEL_FRACTION 0.5), which this run would "
        f"overwrite: give it its own folder, e.g. config.CHECKPOINT.DIR={tmp_path / 'eval_2'}"
    ]
    for job in ("knn", "train"):
        with pytest.raises(
            OtherRunError, match=f"holds the results of a linear_eval job; this run is a {job} job"
        ):
            check_run_folder(load_config([*evaluation, f"config.JOB={job}"]), None)
    same = [
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
        "config.LOGGING.WANDB.ENABLED=True",
        "config.LOG_FREQUENCY=1",
    ]
    check_run_folder(load_config([*evaluation, *same]), None)


def test_keys_added_since_a_folder_was_saved_are_no_difference(tmp_path):
    """A checkpoint saved before a key existed (here: the trunk family's SE_RATIO and a head key
    of another head) resumes: sections compare on the keys both hold."""
    from vistrain.checkpoint.identity import check_same_run

    cfg = load_config(_tiny(tmp_path))
    saved = load_yaml(cfg.dump())
    del saved["MODEL"]["TRUNK"]["REGNET"]["SE_RATIO"]
    saved["MODEL"]["HEAD"].pop("OUT_DIM", None)
    meta = {"num_samples": 32, "config": yaml.safe_dump(saved)}
    check_same_run(str(tmp_path), meta, cfg, 32)
    other_head_key = load_config(
        _tiny(tmp_path, "config.MODEL.HEAD.OUT_DIM=7")
    )  # a key simclr's head does not read
    check_same_run(str(tmp_path), {**meta, "config": cfg.dump()}, other_head_key, 32)


def test_the_ranks_refuse_another_run_before_loading_anything(tmp_path):
    """A job that reaches the ranks without the launcher's check (started from Python, or the
    folder changed meanwhile): resume() refuses in the same one line, agreed by every rank."""
    from types import SimpleNamespace

    from vistrain.checkpoint import EpochLayout
    from vistrain.checkpoint.identity import OtherRunError
    from vistrain.training.resume import resume

    _recorded_run(tmp_path)
    run = SimpleNamespace(layout=EpochLayout(5, 8, 40))  # nothing else is touched before the check
    with pytest.raises(OtherRunError, match=r"data synthetic \(train, 40 samples\)") as refused:
        resume(str(tmp_path), run, load_config(_tiny(tmp_path, "config.DATA.TRAIN.SYNTHETIC_SIZE=40")))
    assert refused.value.agreed and refused.value.exit_code == 2
    assert f"config.CHECKPOINT.DIR={tmp_path}_2" in str(refused.value)
