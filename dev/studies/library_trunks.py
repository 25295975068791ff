"""Prints the blocks found, sharded against DDP, and the planner against the run for timm and torchvision models the tests do not name.

Each model trains the quick start's first 3 steps (SimCLR on the digits, 2 gloo ranks, fp32; SGD
at lr 0.05 instead of its LARS, whose trust ratio ||w|| / ||g|| can blow float noise up to a visible
difference within a step on some models: torchvision's RegNetX-400MF read 3.4e-7 at step 2 and
2.6e-3 at step 3 under LARS, equal to the last bit under SGD) through the launcher twice: sharded by the engine (``AUTO_SETUP_FSDP``, the engine's default knobs)
and under DDP. Printed per model: the family, the block units found from its structure, whether
per-unit initialisation replayed the model or built it whole, the largest relative difference of
the first 3 losses (sharded against DDP), and the planner's peak per rank against the peak RSS the
sharded run logged.

    python dev/studies/library_trunks.py                      # the models below
    python dev/studies/library_trunks.py --models timm:resnet26d torchvision:googlenet
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vistrain.methods import load_config  # noqa: E402
from vistrain.models.trunks import build_trunk  # noqa: E402
from vistrain.planner.memory import plan  # noqa: E402
from vistrain.planner.shape import MIB, run_shape  # noqa: E402

MODELS = [
    "timm:efficientnet_b0",
    "timm:regnety_002",
    "timm:mobilenetv3_small_100",
    "timm:deit_tiny_patch16_224",
    "timm:convnext_atto",
    "torchvision:shufflenet_v2_x0_5",
    "torchvision:mnasnet0_5",
    "torchvision:regnet_x_400mf",
]
KWARGS = {"timm:deit_tiny_patch16_224": "{img_size: 32, patch_size: 4}"}


def overrides(model: str) -> list:
    """The quick start with ``model`` as its trunk, 32-px crops (a ConvNeXt's last stage needs them)."""
    library, name = model.split(":", 1)
    key = "TIMM" if library == "timm" else "TORCHVISION"
    args = [f"config.MODEL.TRUNK.NAME={library}", f"config.MODEL.TRUNK.{key}.NAME={name}"]
    if model in KWARGS:
        args.append(f"config.MODEL.TRUNK.{key}.KWARGS={KWARGS[model]}")
    trunk_cfg = load_config(["config=regnet_fsdp", *args]).MODEL.TRUNK
    with torch.device("meta"):
        width = build_trunk(trunk_cfg).feature_dims["avgpool"]
    return [
        "config=regnet_fsdp",
        *args,
        f"config.MODEL.HEAD.DIMS=[{width},512,128]",
        "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[32]",
        "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False",
        "config.DATA.TRAIN.DATA_LIMIT=384",
        "config.OPTIMIZER.num_epochs=1",
        "config.LOG_FREQUENCY=1",
        "config.MONITOR.EVERY_EPOCHS=0",
        "config.OPTIMIZER.name=sgd",
        "config.OPTIMIZER.param_schedulers.lr.base_value=0.05",
    ]


def train(args: list, run_dir: Path) -> str:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "run_distributed.py"),
            *args,
            f"config.CHECKPOINT.DIR={run_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if out.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{out.stdout[-1500:]}{out.stderr[-1500:]}")
    return out.stdout + out.stderr


def losses(run_dir: Path) -> list:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if "loss" in r][:3]


def study(model: str, root: Path) -> dict:
    args = overrides(model)
    sharded = train([*args, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"], root / "sharded")
    train([*args, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"], root / "ddp")
    a, b = losses(root / "sharded"), losses(root / "ddp")
    blocks = re.search(r"repeated blocks found from its structure: (.*?) \(wrap", sharded)
    planned = (
        plan(run_shape(load_config([*args, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"]))).peak / MIB
    )
    measured = max(int(m) for m in re.findall(r"mem (\d+) MiB", sharded))
    return {
        "model": model,
        "blocks": blocks.group(1) if blocks else "?",
        "init": "whole build" if "per-unit initialisation refused" in sharded else "per unit",
        "rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) == 3 else None,
        "planned": planned,
        "measured": measured,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    args = parser.parse_args()
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(study(model, Path(tmp)))
        r = rows[-1]
        print(f"{model}: done ({r['blocks']})", flush=True)
    print("| model | block units found | init | first 3 losses, sharded vs DDP | planned / logged MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        diff = "missing" if r["rel_diff"] is None else f"{r['rel_diff']:.1e}"
        error = (r["planned"] - r["measured"]) / r["measured"]
        print(
            f"| `{r['model']}` | {r['blocks']} | {r['init']} | {diff} | "
            f"{r['planned']:.0f} / {r['measured']} ({error:+.1%}) |"
        )


if __name__ == "__main__":
    main()
