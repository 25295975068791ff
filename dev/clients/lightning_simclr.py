"""Prints the final loss and time of SimCLR on the digits under Lightning's vistrain_fsdp strategy.

SimCLR on vistrain's RegNet and bundled digits, trained by PyTorch Lightning on vistrain's
sharded engine: ``Trainer(strategy=VistrainFSDPStrategy(...))``.

The LightningModule is written as for DDP (model, loss, optimizer over its own parameters and
a schedule); the recipe is the quick start's (``configs/regnet_fsdp.yaml``, overridable as on the
launcher's command line). Checkpoints are vistrain's sharded folders: resume them on any number
of devices, convert them with ``tools/convert_checkpoint.py``.

    python dev/clients/lightning_simclr.py                              # 2 CPU processes, 1 epoch
    python dev/clients/lightning_simclr.py --epochs 3 config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32
    python dev/clients/lightning_simclr.py --devices 1 --resume checkpoints/lightning_simclr/last.ckpt --epochs 2
    python dev/clients/lightning_simclr.py --accelerator gpu --devices 8 --precision 16-mixed
    python dev/clients/lightning_simclr.py --compare-ddp --max-steps 6  # CPU: the same fit under DDPStrategy

``--compare-ddp`` runs the fit twice from the same seed, under this strategy and under
``DDPStrategy`` (forked ranks), and prints the largest weight difference and the time ratio.
With ``config.OPTIMIZER.name=sgd`` the two are equal bit for bit; LARS sums its norms over
shards in another order, and this small recipe is chaotic (a 1e-7 change of DDP's own start
moves its weights by O(1) within 10 steps), so compare LARS over the first steps only.
"""

import argparse
import time

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch.optim.lr_scheduler import LambdaLR
from torchvision.models.regnet import ResBottleneckBlock, SimpleStemIN

from vistrain.data import build_loader
from vistrain.distributed.sync_batchnorm import convert_sync_batchnorm
from vistrain.integrations.lightning import VistrainFSDPStrategy
from vistrain.methods import build_loss, build_model, load_config
from vistrain.models.heads.mlp import MLP
from vistrain.optim import build_lr_schedule, build_optimizer


class SimCLR(pl.LightningModule):
    """RegNet trunk + MLP head (``build_model``), SimCLR's loss over the global batch."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        model = build_model(cfg.MODEL)
        self.model = (
            convert_sync_batchnorm(model) if cfg.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN else model
        )
        self.criterion = build_loss(cfg.LOSS)

    def training_step(self, batch, batch_idx):
        crops = batch["crops"]
        loss = self.criterion(self.model(crops), len(crops))
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = build_optimizer(self.cfg.OPTIMIZER, self.model)  # LARS, param groups by name
        per_epoch = self.trainer.estimated_stepping_batches // max(1, self.trainer.max_epochs)
        schedule = build_lr_schedule(self.cfg.OPTIMIZER, per_epoch)
        base = float(self.cfg.OPTIMIZER.param_schedulers.lr.base_value)
        return [optimizer], [
            {"scheduler": LambdaLR(optimizer, lambda it: schedule(it) / base), "interval": "step"}
        ]

    def train_dataloader(self):  # vistrain's sampler: Lightning calls its set_epoch
        return build_loader(self.cfg.DATA, "TRAIN", seed=self.cfg.SEED_VALUE, device=self.device)


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "overrides", nargs="*", help="config.A.B=VALUE items (recipe: configs/regnet_fsdp.yaml)"
    )
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--out", default="./checkpoints/lightning_simclr")
    parser.add_argument("--resume", default=None, help="a checkpoint folder written by this script")
    parser.add_argument("--compare-ddp", action="store_true", help="CPU: also fit under DDPStrategy, compare")
    return parser.parse_args()


def fit(args, strategy, checkpoints: bool):
    cfg = load_config(["config=regnet_fsdp", *args.overrides])
    pl.seed_everything(cfg.SEED_VALUE)
    module = SimCLR(cfg)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # build_loader shards the data itself
        callbacks=[ModelCheckpoint(dirpath=args.out, save_last=True)] if checkpoints else [],
        enable_checkpointing=checkpoints,
        logger=False,
    )
    start = time.perf_counter()
    trainer.fit(module, ckpt_path=args.resume)
    return module, trainer, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    start_method = "fork" if args.compare_ddp else "popen"
    # the strategy: units for the stem, every RegNet block and the head MLP; the root wraps the rest
    strategy = VistrainFSDPStrategy(
        auto_wrap_policy=[SimpleStemIN, ResBottleneckBlock, MLP], start_method=start_method
    )
    ours, trainer, seconds = fit(args, strategy, checkpoints=not args.compare_ddp)
    if not trainer.is_global_zero:
        return
    print(f"vistrain_fsdp: final loss {trainer.callback_metrics['loss'].item():.4f}, {seconds:.1f} s")
    if args.compare_ddp:
        reference, trainer, ddp_seconds = fit(args, DDPStrategy(start_method="fork"), checkpoints=False)
        a, b = ours.state_dict(), reference.state_dict()
        diff = max(
            ((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)).item()
            for k in b
        )
        print(f"DDPStrategy:   final loss {trainer.callback_metrics['loss'].item():.4f}, {ddp_seconds:.1f} s")
        print(
            f"largest relative weight difference {diff:.2e}; time vistrain_fsdp / DDP {seconds / ddp_seconds:.2f}"
        )


if __name__ == "__main__":
    main()
