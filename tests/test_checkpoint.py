"""Sharded checkpoints: resume on any world size, crash safety, conversion, weights init, bad input.

Multi-rank cases run real gloo processes (``run_on_ranks``). The reference for "identical state"
is assembled from each rank's own shards with the engine's rank arithmetic, independently of the
checkpoint code.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_models import Block, global_batch, make_net, make_optimizer
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.checkpoint import (
    CheckpointError,
    EpochLayout,
    find_latest_checkpoint,
    load_pretrained,
    load_sharded_checkpoint,
    read_metadata,
    resume_iteration,
    save_sharded_checkpoint,
)
from vistrain.checkpoint import save as save_module
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import FullyShardedDataParallel as FSDP
from vistrain.fsdp import auto_wrap, by_class, local_part
from vistrain.methods import load_config
from vistrain.training.trainer import train

REPO = Path(__file__).resolve().parents[1]
GLOBAL = 12  # images per step: divisible by 1, 2 and 3 ranks, so every world size sees the same batch
SAVED_AT, MORE = 3, 2


# --------------------------------------------------------------------------------------------
# resume on 1, 2, 3 ranks and across wrappers


def _build(wrapper, seed):
    net = make_net(seed)
    net.stem.bias.requires_grad_(False)  # a frozen parameter: no optimizer state
    if wrapper == "fsdp":
        return auto_wrap(net, by_class([Block, nn.Linear]))
    return DDP(net)


def _step(model, optimizer, step, rank, world):
    x, y = global_batch(step, world=1, per_rank=GLOBAL)
    per = GLOBAL // world
    loss = nn.functional.cross_entropy(
        model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    return reported.item() / world


def _owned_state(model, optimizer):
    """{fqn: {"start", "param", state key...}} of what this rank holds, straight from its tensors."""
    out = {}
    for p in model.parameters():
        state = optimizer.state.get(p, {})
        if isinstance(model, FSDP):
            part = local_part(p)
            pieces = [(part.origin.fqn, 0, part.start, part.length)] if part.length else []
        else:
            fqn = next(n for n, q in model.module.named_parameters() if q is p)
            pieces = [(fqn, 0, 0, p.numel())]
        for fqn, off, start, n in pieces:
            entry = {"start": start, "param": p.detach().reshape(-1)[off : off + n].clone()}
            for key, value in state.items():
                entry[key] = value.reshape(-1)[off : off + n].clone() if value.dim() else value.clone()
            out[fqn] = entry
    return out


def _assemble(per_rank):
    """Merge the ranks' pieces into whole flattened tensors per fqn and state key."""
    full = {}
    for owned in per_rank:
        for fqn, entry in owned.items():
            for key, value in entry.items():
                if key == "start":
                    continue
                if value.dim() == 0:  # "step": one per shard, all equal
                    full.setdefault(fqn, {})[key] = value
                    continue
                target = full.setdefault(fqn, {}).setdefault(key, {})
                for i, v in enumerate(value.tolist()):
                    target[entry["start"] + i] = v
    return {
        fqn: {k: (v if torch.is_tensor(v) else torch.tensor([v[i] for i in sorted(v)])) for k, v in d.items()}
        for fqn, d in full.items()
    }


def _save_worker(rank, world, optim_name, run_dir):
    model = _build("fsdp", seed=0)
    optimizer = make_optimizer(optim_name, [p for p in model.parameters() if p.requires_grad])
    for step in range(SAVED_AT):
        _step(model, optimizer, step, rank, world)
    save_sharded_checkpoint(run_dir, SAVED_AT, model, optimizer, {"rank": rank}, {}, keep_last=0)
    saved = _owned_state(model, optimizer)
    losses = [_step(model, optimizer, step, rank, world) for step in range(SAVED_AT, SAVED_AT + MORE)]
    return saved, losses


def _resume_worker(rank, world, optim_name, run_dir, wrapper):
    model = _build(wrapper, seed=1)  # other initial weights: everything must come from the file
    optimizer = make_optimizer(optim_name, [p for p in model.parameters() if p.requires_grad])
    loaded = load_sharded_checkpoint(find_latest_checkpoint(run_dir), model, optimizer)
    state = _owned_state(model, optimizer)
    losses = [_step(model, optimizer, step, rank, world) for step in range(SAVED_AT, SAVED_AT + MORE)]
    return state, losses, loaded["extra"], loaded["same_world_size"]


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_resume_on_any_world_size_and_wrapper(tmp_path, optim_name):
    saved = run_on_ranks(_save_worker, 2, optim_name, str(tmp_path))
    reference = _assemble([s for s, _ in saved])
    continued = saved[0][1]
    assert set(os.listdir(tmp_path / "checkpoint_3")) == {"metadata.json", "rank0.pt", "rank1.pt"}
    assert "stem.bias" in reference and "momentum_buffer" not in reference["stem.bias"]
    for world, wrapper in [(1, "fsdp"), (2, "fsdp"), (3, "fsdp"), (2, "ddp")]:
        results = run_on_ranks(_resume_worker, world, optim_name, str(tmp_path), wrapper)
        state = _assemble([r[0] for r in results])
        assert state.keys() == reference.keys()
        for fqn in reference:
            assert state[fqn].keys() == reference[fqn].keys(), (world, fqn)
            for key in reference[fqn]:
                assert torch.equal(state[fqn][key], reference[fqn][key]), (world, wrapper, fqn, key)
        torch.testing.assert_close(results[0][1], continued, rtol=0, atol=1e-6)
        assert results[0][3] == (world == 2)
        assert [r[2]["rank"] for r in results] == ([0, 1] if world == 2 else [0] * world)


# --------------------------------------------------------------------------------------------
# the trainer: SIGKILL mid-epoch, interrupted save, position mapping


def _tiny(run_dir, *overrides):
    return [
        "config=test/simclr_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.LOG_FREQUENCY=1",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=3",
        "config.CHECKPOINT.KEEP_LAST=2",
        *overrides,
    ]


def _losses(run_dir):
    """iteration -> loss; a resumed run's lines come later and win over the killed run's."""
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return {m["iteration"]: m["loss"] for m in map(json.loads, lines)}


def _train_worker(rank, world, argv, fail_at=None):
    if fail_at is not None:  # rank 1 runs out of disk half-way through one rank file
        original = save_module.save_file

        def half_then_full_disk(obj, path):
            if rank == 1 and f"checkpoint_{fail_at}" in path:
                with open(path, "wb") as f:
                    f.write(b"PK\x03\x04 half a zip")
                raise OSError(28, "No space left on device")
            original(obj, path)

        save_module.save_file = half_then_full_disk
    train(load_config(argv))


def test_sigkill_mid_epoch_then_auto_resume_gives_the_same_losses(tmp_path):
    """Killed (launcher and ranks, SIGKILL) right after its first checkpoint, mid-epoch; then
    auto-resumed: the losses of every iteration equal those of an uninterrupted run."""
    argv = _tiny(tmp_path / "killed", "config.OPTIMIZER.num_epochs=6")  # 24 iterations, 4 per epoch
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "run_distributed.py"), *argv],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log = tmp_path / "killed" / "log.txt"
    while proc.poll() is None and not (log.exists() and " saved " in log.read_text()):
        time.sleep(0.005)  # the first checkpoint is complete once its "saved" line is logged
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks, wherever they are
    proc.wait()
    latest = find_latest_checkpoint(str(tmp_path / "killed"))
    assert latest is not None and read_metadata(latest)["iteration"] < 24, "the run ended before the kill"
    run_on_ranks(_train_worker, 2, argv)  # AUTO_RESUME is on by default
    run_on_ranks(_train_worker, 2, _tiny(tmp_path / "full", "config.OPTIMIZER.num_epochs=6"))
    assert "resumed from" in (tmp_path / "killed" / "log.txt").read_text()
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 25))
    assert resumed == full


def test_interrupted_save_leaves_the_previous_checkpoint_to_resume(tmp_path):
    argv = _tiny(tmp_path, "config.OPTIMIZER.num_epochs=2")  # checkpoints at 3, 4 (epoch end), 6, 8
    with pytest.raises(RuntimeError, match="saving .*checkpoint_4 failed .*No space left on device"):
        run_on_ranks(_train_worker, 2, argv, 4)
    assert find_latest_checkpoint(str(tmp_path)).endswith("checkpoint_3")  # mid-epoch
    assert (tmp_path / "checkpoint_4.tmp").is_dir() and not (tmp_path / "checkpoint_4").exists()
    (tmp_path / "checkpoint_7").mkdir()  # a final name without metadata.json is ignored too
    run_on_ranks(_train_worker, 2, argv)
    assert "resumed from" in (tmp_path / "log.txt").read_text()
    run_on_ranks(_train_worker, 2, _tiny(tmp_path / "ref", "config.OPTIMIZER.num_epochs=2"))
    assert _losses(tmp_path) == _losses(tmp_path / "ref")
    assert {"checkpoint_6", "checkpoint_8"} <= {p.name for p in tmp_path.glob("checkpoint_*")}
    assert not (tmp_path / "checkpoint_4.tmp").exists() and not (tmp_path / "checkpoint_3").exists()


@pytest.mark.parametrize(
    "saved, now, expected",
    [
        ((4, 8, 2), (4, 8, 1), 6),  # unchanged: exact (epoch 1, 2 iterations in)
        ((4, 8, 2), (2, 16, 1), 3),  # 16 samples done = 1 batch of 16
        ((4, 8, 3), (3, 12, 1), 5),  # 24 samples = 2 batches of 12
        ((4, 8, 1), (3, 12, 1), 3),  # 8 samples: restart the epoch at its start (8 seen again)
        ((4, 8, 3), (8, 4, 2), 14),  # 24 samples = 6 batches of 4, accumulation groups of 2
    ],
)
def test_resume_position_maps_samples_seen(saved, now, expected):
    ipe, batch, done = saved
    meta = {
        "epoch": 1,
        "iteration_in_epoch": done,
        "iteration": ipe + done,
        "iters_per_epoch": ipe,
        "global_batch": batch,
        "num_samples": 32,
    }
    layout = EpochLayout(now[0], now[1], 32, now[2])
    assert resume_iteration(meta, layout, "ckpt") == expected
    with pytest.raises(ValueError, match="trained on 32 samples, this run has 40"):
        resume_iteration(meta, EpochLayout(now[0], now[1], 40, 1), "ckpt")


# --------------------------------------------------------------------------------------------
# conversion and weights init


def _weights_cfg(cfg, path, **kw):
    weights = cfg.MODEL.WEIGHTS_INIT.clone()
    weights.defrost()
    weights.PARAMS_FILE = path
    for key, value in kw.items():
        setattr(weights, key, value)
    return weights


def _plain_checkpoint(run_dir, model=None):
    """Single process (the collectives are no-ops): a plain model with SGD momentum state."""
    model = model if model is not None else make_net(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = global_batch(0, world=1)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    return save_sharded_checkpoint(str(run_dir), 1, model, optimizer, {}, {}, keep_last=0), model


def test_load_pretrained_maps_prefixes_skips_and_reports(tmp_path):
    cfg = load_config(["config=test/simclr_tiny"])
    source = make_net(0)
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "c.pt")
    target = make_net(1)
    untouched = target.twice.weight.detach().clone()
    report = load_pretrained(
        target, _weights_cfg(cfg, str(tmp_path / "c.pt"), REMOVE_PREFIX="module.", SKIP_LAYERS=["twice."])
    )
    assert report.skipped == ["twice.weight", "twice.bias"] and not report.missing and not report.unexpected
    assert torch.equal(target.stem.weight, source.stem.weight) and torch.equal(target.twice.weight, untouched)
    outer = nn.Sequential()
    outer.add_module("trunk", make_net(2))
    outer.add_module("extra", nn.Linear(2, 2))
    path, _ = _plain_checkpoint(tmp_path / "run")  # a sharded checkpoint folder
    report = load_pretrained(outer, _weights_cfg(cfg, path, APPEND_PREFIX="trunk."))
    assert report.missing == ["extra.weight", "extra.bias"] and len(report.loaded) == len(source.state_dict())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(outer, _weights_cfg(cfg, str(tmp_path / "nope.pt")))


def test_checkpoint_of_another_model_gives_a_one_line_error(tmp_path):
    from fsdp_models import Net

    path, _ = _plain_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_sharded_checkpoint(path, Net(channels=6), None)
    assert "\n" not in str(err.value) and path in str(err.value)
    assert "stem.weight has shape (5, 3, 3, 3) in the checkpoint but (6, 3, 3, 3) in the model" in str(
        err.value
    )
    with pytest.raises(CheckpointError, match=r"the model's parameter '0.weight' is not in the checkpoint"):
        load_sharded_checkpoint(path, nn.Sequential(nn.Linear(2, 2)), None)
    cfg = load_config(["config=test/simclr_tiny"])
    with pytest.raises(CheckpointError) as err:
        load_pretrained(Net(channels=6), _weights_cfg(cfg, path))
    assert "\n" not in str(err.value)
    expected = "stem.weight has shape (5, 3, 3, 3) but the model's stem.weight has shape (6, 3, 3, 3)"
    assert str(err.value).endswith(expected)
    with pytest.raises(CheckpointError, match="optimizer state of SGD, this run uses AdamW"):
        model = make_net(0)
        load_sharded_checkpoint(path, model, torch.optim.AdamW(model.parameters()))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_truncated_corrupt_and_code_carrying_files_give_one_line_errors(tmp_path):
    path, _ = _plain_checkpoint(tmp_path / "run")
    rank0 = Path(path, "rank0.pt")
    rank0.write_bytes(rank0.read_bytes()[: rank0.stat().st_size // 2])
    with pytest.raises(CheckpointError) as err:
        load_sharded_checkpoint(path, make_net(0), None)
    assert str(err.value).startswith(f"{rank0}: corrupt, truncated or unsafe checkpoint file")
    assert "\n" not in str(err.value)
    marker = tmp_path / "code_ran"
    torch.save({"w": torch.zeros(1), "payload": _RunsCode(str(marker))}, tmp_path / "evil.pt")
    cfg = load_config(["config=test/simclr_tiny"])
    with pytest.raises(CheckpointError, match="evil.pt: corrupt, truncated or unsafe"):
        load_pretrained(make_net(0), _weights_cfg(cfg, str(tmp_path / "evil.pt")))
    assert not marker.exists()  # loading never executed the file's code
    Path(path, "metadata.json").write_text("{")
    assert find_latest_checkpoint(str(tmp_path / "run")) is None
    with pytest.raises(CheckpointError, match="metadata.json: unreadable metadata"):
        read_metadata(path)


# --------------------------------------------------------------------------------------------
# PyTorch's fully_shard backend (TorchShardedModel) shares the format


def _torch_sharded(seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vistrain.fsdp import TorchShardedModel

    net = make_net(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return TorchShardedModel(net)


def _torch_backend_worker(rank, world, run_dir, save_with, load_with):
    build = {
        "torch": _torch_sharded,
        "fsdp": lambda seed: auto_wrap(make_net(seed), by_class([Block, nn.Linear])),
    }
    if save_with is not None:
        model = build[save_with](0)
        optimizer = make_optimizer("adamw", model.parameters())
        for step in range(SAVED_AT):
            _step(model, optimizer, step, rank, world)
        save_sharded_checkpoint(run_dir, SAVED_AT, model, optimizer, {}, {}, keep_last=0)
    else:
        model = build[load_with](1)
        optimizer = make_optimizer("adamw", model.parameters())
        load_sharded_checkpoint(find_latest_checkpoint(run_dir), model, optimizer)
    return [_step(model, optimizer, step, rank, world) for step in range(SAVED_AT, SAVED_AT + MORE)]


def test_torch_fully_shard_backend_saves_and_loads_the_same_format(tmp_path):
    continued = run_on_ranks(_torch_backend_worker, 2, str(tmp_path / "t"), "torch", None)[0]
    resumed = run_on_ranks(_torch_backend_worker, 1, str(tmp_path / "t"), None, "fsdp")[0]
    torch.testing.assert_close(resumed, continued, rtol=0, atol=1e-6)
    continued = run_on_ranks(_torch_backend_worker, 2, str(tmp_path / "f"), "fsdp", None)[0]
    resumed = run_on_ranks(_torch_backend_worker, 2, str(tmp_path / "f"), None, "torch")[0]
    torch.testing.assert_close(resumed, continued, rtol=0, atol=1e-6)
