"""Prints the Lightning strategy's CUDA parity, precisions and memory against DDPStrategy (JSON).

The prepared CUDA check of the Lightning strategy: ``Trainer(strategy=VistrainFSDPStrategy,
accelerator="gpu")`` against ``DDPStrategy`` on the visible GPUs (one H200 in this project's
device sessions: world size 1 with NCCL, every process started in this one).

    python dev/gpu/gpu_check_lightning.py [--out DIR]   # prints JSON; writes DIR/gpu_check_lightning.json
    python dev/gpu/gpu_check_lightning.py --cpu          # the same script on 2 CPU processes (forked)

Per precision (32-true, bf16-mixed, 16-mixed with the sharded scaler on cuda), with gradient
clipping and accumulation: the largest relative weight difference from DDP after two epochs;
then a sharded checkpoint written after epoch 0 and resumed (its epoch 1 against the
uninterrupted run's), and each run's peak CUDA memory. CPU-only machines without ``--cpu``: a
message (the CPU paths are covered by tests/test_lightning.py).
"""

import argparse
import json
import os
import sys
import tempfile

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vistrain.integrations.lightning import VistrainFSDPStrategy


class Net(pl.LightningModule):
    """Conv body, BatchNorm, head and a parameter of its own; SGD with param groups."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten()
        )
        self.head = nn.Linear(16 * 14 * 14, 10)
        self.scale = nn.Parameter(torch.ones(10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.body(x)).float() * self.scale, y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 1e-4}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.02, momentum=0.9)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(128, 3, 16, 16, generator=gen), torch.randint(0, 10, (128,), generator=gen)
        )
        return DataLoader(data, batch_size=16)


def fit(strategy, accelerator, devices, precision, epochs=2, ckpt_path=None, callbacks=()):
    pl.seed_everything(0)
    module = Net()
    plugins = {}
    if precision == "16-mixed" and accelerator == "cpu":  # the Trainer would pick bf16 on CPU
        plugins = {"plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu")]}
    else:
        plugins = {"precision": precision}
    trainer = pl.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_epochs=epochs,
        gradient_clip_val=1.0, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks), **plugins,
    )  # fmt: skip
    if accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, ckpt_path=ckpt_path)
    peak = torch.cuda.max_memory_allocated() / 2**20 if accelerator == "gpu" else None
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}, peak


def rel(a, b) -> float:
    return max(
        ((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)).item()
        for k in b
    )


def checks(accelerator: str, devices: int, start_method: str, folder: str) -> dict:
    out = {}
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        ddp, ddp_peak = fit(DDPStrategy(start_method=start_method), accelerator, devices, precision)
        ours, peak = fit(VistrainFSDPStrategy(start_method=start_method), accelerator, devices, precision)
        out[precision] = {"weights_vs_ddp": rel(ours, ddp), "peak_mib": peak, "ddp_peak_mib": ddp_peak}
    saver = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)
    straight, _ = fit(
        VistrainFSDPStrategy(start_method=start_method), accelerator, devices, "32-true", callbacks=[saver]
    )
    resumed, _ = fit(
        VistrainFSDPStrategy(start_method=start_method), accelerator, devices, "32-true",
        ckpt_path=os.path.join(folder, "epoch=0.ckpt"),
    )  # fmt: skip
    out["resume_vs_uninterrupted"] = rel(resumed, straight)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="folder for gpu_check_lightning.json")
    parser.add_argument("--cpu", action="store_true", help="run on 2 forked CPU processes instead")
    args = parser.parse_args()
    if args.cpu:
        accelerator, devices, start_method = "cpu", 2, "fork"
    elif torch.cuda.is_available():
        accelerator, devices, start_method = "gpu", torch.cuda.device_count(), "popen"
    else:
        print(
            "no CUDA device: nothing to check here (tests/test_lightning.py covers the CPU paths; --cpu runs this script there)"
        )
        return 0
    with tempfile.TemporaryDirectory() as folder:
        result = {
            "accelerator": accelerator,
            "devices": devices,
            **checks(accelerator, devices, start_method, folder),
        }
    text = json.dumps(result, indent=1)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(text)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_check_lightning.json"), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
