"""dev/recipes/compare_runs.py: two runs agree only when every logged loss and every checkpoint tensor does."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "dev" / "recipes" / "compare_runs.py"
LOG = "[10:00:00 vistrain] epoch 1/1  it {it}/20  loss {loss} (avg {loss})  lr 0.1  10.0 img/s  eta 0:00:01\n"


def _run(folder: Path, losses, weight: torch.Tensor, created: str) -> Path:
    folder.mkdir()
    (folder / "log.txt").write_text(
        "".join(LOG.format(it=10 * (i + 1), loss=loss) for i, loss in enumerate(losses))
    )
    for iteration in (10, 20):
        checkpoint = folder / f"checkpoint_{iteration}"
        checkpoint.mkdir()
        torch.save(
            {"model": {"w": weight * iteration}, "optimizer": [{"step": torch.tensor(iteration)}]},
            checkpoint / "rank0.pt",
        )
        (checkpoint / "metadata.json").write_text(json.dumps({"created": created, "world_size": 1}))
    return folder


def _compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True)


def test_identical_runs_agree_whatever_their_creation_time(tmp_path):
    weight = torch.randn(3, 4)
    a = _run(tmp_path / "a", ["5.5228", "4.0015"], weight, "2026-12-04T14:13:59")
    b = _run(tmp_path / "b", ["5.5228", "4.0015"], weight.clone(), "2026-12-04T15:14:43")
    result = _compare(a, b)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 2 logged lines agree" in result.stdout
    assert "checkpoint_20: metadata.json entries that differ: created" in result.stdout
    assert "rank0.pt: 2 tensors, 0 differ" in result.stdout


def test_a_differing_loss_or_tensor_is_reported_and_fails(tmp_path):
    weight = torch.randn(3, 4)
    a = _run(tmp_path / "a", ["5.5228", "4.0015"], weight, "t")
    other_loss = _run(tmp_path / "b", ["5.5228", "4.0016"], weight, "t")
    result = _compare(a, other_loss)
    assert (
        result.returncode == 1 and "first difference at it 20: 4.0015 (A) against 4.0016 (B)" in result.stdout
    )
    nudged = weight.clone()
    nudged[0, 0] += 0.25
    other_tensor = _run(tmp_path / "c", ["5.5228", "4.0015"], nudged, "t")
    result = _compare(a, other_tensor)
    assert (
        result.returncode == 1 and "rank0.pt: 2 tensors, 1 differ (largest |difference| 5)" in result.stdout
    )


def test_logged_losses_are_read_as_printed(tmp_path):
    spec = importlib.util.spec_from_file_location("compare_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.logged_losses(_run(tmp_path / "a", ["1.0"], torch.zeros(1), "t")) == [(10, "1.0", "1.0")]
