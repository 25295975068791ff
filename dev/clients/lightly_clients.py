"""Prints the gaps of vistrain_fsdp to DDP for lightly's SimCLR, BYOL, SwAV and DINO examples.

lightly's own Lightning examples (SimCLR, BYOL, SwAV, DINO) under DDP and under vistrain_fsdp.

    pip install --no-deps --target /tmp/lightly lightly   # the library only, as a test oracle
    PYTHONPATH=/tmp/lightly python dev/clients/lightly_clients.py [--steps 6] [--methods swav dino]

Each LightningModule is lightly's documented example (a ResNet-18 trunk, lightly's heads, losses
and momentum utilities: ``update_momentum`` assigns ``.data``, ``SwaVPrototypes.normalize()``
divides the prototype rows in place, ``cancel_last_layer_gradients`` sets ``p.grad = None``),
trained for a few steps on 2 CPU ranks on random multi-crop views with the same seed under
``strategy="ddp"`` and ``strategy="vistrain_fsdp"`` (forked ranks, gloo). Prints, per method,
the worst relative difference of the logged losses and of the final weights (teacher included)
and whether either run produced NaN.
"""

import argparse
import copy
import json
import os
import tempfile

import pytorch_lightning as pl
import torch
import torchvision
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vistrain.integrations.lightning import VistrainFSDPStrategy


def _resnet18_trunk():
    resnet = torchvision.models.resnet18()
    return nn.Sequential(*list(resnet.children())[:-1])


class Views(Dataset):
    """Random images as multi-crop views: 2 at 32 px, then ``small`` at 16 px."""

    def __init__(self, small: int, n: int = 64):
        self.small, self.n = small, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        views = [torch.randn(3, 32, 32, generator=g) for _ in range(2)]
        views += [torch.randn(3, 16, 16, generator=g) for _ in range(self.small)]
        return views, 0


class Example(pl.LightningModule):
    small_views = 0

    def train_dataloader(self):
        return DataLoader(Views(self.small_views), batch_size=4, shuffle=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0:
            with open(os.environ["LOSSES_FILE"], "a") as f:
                f.write(json.dumps(float(outputs["loss"])) + "\n")


class SimCLR(Example):
    def __init__(self):
        from lightly.loss import NTXentLoss
        from lightly.models.modules import SimCLRProjectionHead

        super().__init__()
        self.backbone = _resnet18_trunk()
        self.projection_head = SimCLRProjectionHead(512, 512, 128)
        self.criterion = NTXentLoss(gather_distributed=True)

    def forward(self, x):
        return self.projection_head(self.backbone(x).flatten(start_dim=1))

    def training_step(self, batch, batch_idx):
        x0, x1 = batch[0][:2]
        return self.criterion(self.forward(x0), self.forward(x1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.06)


class BYOL(Example):
    def __init__(self):
        from lightly.loss import NegativeCosineSimilarity
        from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        super().__init__()
        self.backbone = _resnet18_trunk()
        self.projection_head = BYOLProjectionHead(512, 1024, 256)
        self.prediction_head = BYOLPredictionHead(256, 1024, 256)
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)
        self.criterion = NegativeCosineSimilarity()

    def forward(self, x):
        return self.prediction_head(self.projection_head(self.backbone(x).flatten(start_dim=1)))

    def forward_momentum(self, x):
        return self.projection_head_momentum(self.backbone_momentum(x).flatten(start_dim=1)).detach()

    def training_step(self, batch, batch_idx):
        from lightly.models.utils import update_momentum
        from lightly.utils.scheduler import cosine_schedule

        momentum = cosine_schedule(self.current_epoch, 10, 0.996, 1)
        update_momentum(self.backbone, self.backbone_momentum, m=momentum)
        update_momentum(self.projection_head, self.projection_head_momentum, m=momentum)
        x0, x1 = batch[0][:2]
        p0, z0 = self.forward(x0), self.forward_momentum(x0)
        p1, z1 = self.forward(x1), self.forward_momentum(x1)
        return 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.06)


class SwaV(Example):
    small_views = 4

    def __init__(self):
        from lightly.loss import SwaVLoss
        from lightly.models.modules import SwaVProjectionHead, SwaVPrototypes

        super().__init__()
        self.backbone = _resnet18_trunk()
        self.projection_head = SwaVProjectionHead(512, 512, 128)
        self.prototypes = SwaVPrototypes(128, n_prototypes=512)
        self.criterion = SwaVLoss()

    def forward(self, x):
        x = self.projection_head(self.backbone(x).flatten(start_dim=1))
        return self.prototypes(nn.functional.normalize(x, dim=1, p=2))

    def training_step(self, batch, batch_idx):
        self.prototypes.normalize()
        features = [self.forward(view) for view in batch[0]]
        return self.criterion(features[:2], features[2:])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.001)


class DINO(Example):
    small_views = 4

    def __init__(self):
        from lightly.loss import DINOLoss
        from lightly.models.modules import DINOProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        super().__init__()
        backbone = _resnet18_trunk()
        self.student_backbone = backbone
        self.student_head = DINOProjectionHead(512, 512, 64, 2048, freeze_last_layer=1)
        self.teacher_backbone = copy.deepcopy(backbone)
        self.teacher_head = DINOProjectionHead(512, 512, 64, 2048)
        deactivate_requires_grad(self.teacher_backbone)
        deactivate_requires_grad(self.teacher_head)
        self.criterion = DINOLoss(output_dim=2048, warmup_teacher_temp_epochs=5)

    def forward(self, x):
        return self.student_head(self.student_backbone(x).flatten(start_dim=1))

    def forward_teacher(self, x):
        return self.teacher_head(self.teacher_backbone(x).flatten(start_dim=1))

    def training_step(self, batch, batch_idx):
        from lightly.models.utils import update_momentum
        from lightly.utils.scheduler import cosine_schedule

        momentum = cosine_schedule(self.current_epoch, 10, 0.996, 1)
        update_momentum(self.student_backbone, self.teacher_backbone, m=momentum)
        update_momentum(self.student_head, self.teacher_head, m=momentum)
        views = batch[0]
        teacher_out = [self.forward_teacher(view) for view in views[:2]]
        student_out = [self.forward(view) for view in views]
        return self.criterion(teacher_out, student_out, epoch=self.current_epoch)

    def on_after_backward(self):
        self.student_head.cancel_last_layer_gradients(current_epoch=self.current_epoch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.001)


METHODS = {"simclr": SimCLR, "byol": BYOL, "swav": SwaV, "dino": DINO}


def run(cls, strategy, steps: int, precision: str):
    """Losses (rank 0) and final weights of one fit."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as losses:
        os.environ["LOSSES_FILE"] = losses.name
        pl.seed_everything(0)
        module = cls()
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, precision=precision,
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(module)
        values = [json.loads(line) for line in losses.read().splitlines()]
    return torch.tensor(values), {k: v.detach().clone() for k, v in module.state_dict().items()}


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    for name in args.methods:
        cls = METHODS[name]
        ddp_losses, ddp_state = run(cls, DDPStrategy(start_method="fork"), args.steps, args.precision)
        ours_losses, ours_state = run(
            cls, VistrainFSDPStrategy(start_method="fork"), args.steps, args.precision
        )
        weights = max(rel(ours_state[k], ddp_state[k]) for k in ddp_state if ddp_state[k].is_floating_point())
        nan = any(not torch.isfinite(v).all() for v in ours_state.values() if v.is_floating_point())
        print(
            f"{name}: losses {ours_losses.tolist()} | DDP {ddp_losses.tolist()}\n"
            f"{name}: worst relative difference: losses {rel(ours_losses, ddp_losses):.2e}, "
            f"weights {weights:.2e}; NaN in ours: {nan}",
            flush=True,
        )


if __name__ == "__main__":
    main()
