"""Run tracking: Weights & Biases as a second sink of the scalars and images (off by default; an
offline run written when asked, read back here), and every run folder's provenance.json."""

import glob
import json
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vistrain.config import ConfigError
from vistrain.jobs import check_values
from vistrain.methods import load_config
from vistrain.runtime import tracking
from vistrain.runtime.logger import TrainingMeter
from vistrain.runtime.pictures import save_picture
from vistrain.runtime.run_setup import record_config

REPO = Path(__file__).resolve().parents[1]


def _records(path: str):
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header, then 32 KiB
    blocks of chunks (crc32 u32, length u16, type u8: 1 whole, 2 first, 3 middle, 4 last; payload)."""
    data, block, pos, parts = Path(path).read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield parts
            parts = b""


def _history(run_dir: Path):
    """Every history row W&B wrote for the offline run in ``run_dir``: [{key: value}]."""
    from wandb.proto import wandb_internal_pb2

    [log] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = []
    for payload in _records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def test_wandb_mirrors_the_scalars_and_images_offline_in_the_run_folder(tmp_path, monkeypatch):
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(variable, str(tmp_path / "home"))
    for variable in ("WANDB_X_DISABLE_STATS", "WANDB_X_DISABLE_META"):  # W&B's system probes: seconds
        monkeypatch.setenv(variable, "true")
    settings = tracking.WandbSettings("vistrain-tests", "", "offline", "train", {"SEED_VALUE": 0})
    meter = TrainingMeter(str(tmp_path), 1, 2, torch.device("cpu"), tracking=settings)
    for iteration, loss in ((1, 2.5), (2, 1.5)):
        meter.update(torch.tensor(loss), num_images=8)
        meter.log(iteration, 0, 1, lr=0.1)
    meter.write_values({"iteration": 2, "epoch": 0, "knn_top1": 87.5}, "monitor")
    picture = Image.fromarray(np.full((6, 10, 3), 200, dtype=np.uint8))
    save_picture(picture, str(tmp_path), "views.png", meter.writer, "train/views", 2)
    run_id = meter.writer.wandb.run.id
    meter.close()

    rows = _history(tmp_path)
    assert [(r["iteration"], r["train/loss"]) for r in rows if "train/loss" in r] == [(1, 2.5), (2, 1.5)]
    assert [r["monitor/knn_top1"] for r in rows if "monitor/knn_top1" in r] == [87.5]
    [image] = [r for r in rows if "train/views/path" in r]  # the image, a file of the run
    assert image["iteration"] == 2 and (image["train/views/width"], image["train/views/height"]) == (10, 6)
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / image["train/views/path"]))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard as ever
    # a resumed run in this folder continues the same W&B run
    assert tracking._run_id(str(tmp_path / "wandb")) == run_id


def test_wandb_is_off_by_default_and_asks_for_its_extra(monkeypatch):
    cfg = load_config(["config=test/simclr_tiny"])
    assert tracking.wandb_settings(cfg) is None
    on = load_config(
        ["config=test/simclr_tiny", "config.LOGGING.WANDB.ENABLED=True", "config.LOGGING.WANDB.MODE=offline"]
    )
    assert (
        tracking.wandb_settings(on).mode == "offline" and tracking.wandb_settings(on).config["JOB"] == "train"
    )
    with pytest.raises(ConfigError, match="LOGGING.WANDB.MODE must be one of"):
        check_values(load_config(["config=test/simclr_tiny", "config.LOGGING.WANDB.MODE=cloud"]), files=False)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r'LOGGING.WANDB.ENABLED needs wandb: pip install "vistrain\[wandb\]"'
    ):
        check_values(on, files=False)


def test_every_launch_adds_its_provenance(tmp_path):
    cfg = load_config(
        ["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={tmp_path}", "config.MACHINE.DEVICE=cpu"]
    )
    record_config(cfg)
    record_config(cfg, trained_until=8)  # the same run resumed: one more record, config.yaml as it was
    launches = json.loads((tmp_path / "provenance.json").read_text())["launches"]
    assert [launch["resumed_from"] for launch in launches] == [0, 8]
    first = launches[0]
    assert first["job"] == "train" and first["world_size"] == 1 and first["device"].startswith("cpu: ")
    assert first["command"] == shlex.join([sys.executable, *sys.argv])
    assert first["torch"] == torch.__version__ and first["cuda"] == torch.version.cuda
    assert first["python"] == ".".join(map(str, sys.version_info[:3]))
    import vistrain

    assert first["vistrain"] == vistrain.__version__ and first["host"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: its commit and whether it had uncommitted changes
        assert first["git"]["commit"] == head.stdout.strip() and isinstance(first["git"]["dirty"], bool)
    assert all(isinstance(name, str) for name in first["extras"])  # {distribution: version or None}
    assert sorted(p.name for p in tmp_path.glob("config*.yaml")) == ["config.yaml"]


def test_a_wandb_run_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    settings = tracking.WandbSettings("vistrain-tests", "", "online", "train", {})
    with pytest.raises(ConfigError) as refused:
        tracking.WandbSink(settings, str(tmp_path))
    assert str(refused.value) == (
        "LOGGING.WANDB: Weights & Biases could not start a run: No API key configured. Use `wandb login` "
        "to log in; or set LOGGING.WANDB.MODE=offline (no account or network needed)"
    )
