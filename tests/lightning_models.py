"""LightningModules, data and a recorder shared by the Lightning strategy tests (importable, so
any start method can pickle them)."""

import copy
import json
import os

import pytorch_lightning as pl
import torch
from lightly.models import utils
from lightly.models.modules import MaskedVisionTransformerTorchvision
from lightly.models.modules.masked_autoencoder import MAEDecoder
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models import VisionTransformer

from vistrain.integrations.lightning.strategy import _own_storage

SAMPLES = 48  # 4 global batches of 12: per device 12, 6 or 4 on 1, 2 or 3 devices


class OwnStorageDDP(DDPStrategy):
    """The DDP reference for ranks started by ``forkserver``: Lightning hands them the module in
    shared memory (it copies only under ``spawn``), so each rank first takes its own copy, as
    VistrainFSDPStrategy does; otherwise every rank steps one set of weights."""

    def setup(self, trainer) -> None:
        _own_storage(self.model)
        super().setup(trainer)


def dataset(seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 8, generator=gen)
    return TensorDataset(x, torch.tanh(x[:, :3] * 1.5) + 0.1 * torch.randn(SAMPLES, 3, generator=gen))


class Regressor(pl.LightningModule):
    """A body, a head and a parameter of its own (the root unit's); param groups by name (no
    weight decay, another learning rate for biases and the scale), a schedule changing the learning
    rate at every step (a resume must restore it before the scheduler's next step)."""

    def __init__(self, batch_size: int = 6, optimizer: str = "sgd", norm: bool = False):
        super().__init__()
        self.save_hyperparameters()
        # BatchNorm (unsynchronised: its statistics depend on the device count) only where asked
        norm_layer = [nn.BatchNorm1d(32)] if norm else []
        self.body = nn.Sequential(
            nn.Linear(8, 32, bias=not norm), *norm_layer, nn.Tanh(), nn.Linear(32, 16), nn.Tanh()
        )
        self.head = nn.Linear(16, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.head(self.body(x)) * self.scale

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 1e-2}, {"params": rest, "weight_decay": 0.0, "lr": 0.05}]
        if self.hparams.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=0.01)
        else:
            optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(dataset(0), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(dataset(1), batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(dataset(2), batch_size=self.hparams.batch_size)


class ConvNet(pl.LightningModule):
    """Convolutions with BatchNorm in a ``Sequential`` body, a head and a parameter of its own;
    classification of small images (the mixed-precision checks)."""

    def __init__(self, batch_size: int = 6):
        super().__init__()
        self.batch_size = batch_size
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(32, 5)
        self.scale = nn.Parameter(torch.ones(5))

    def loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.body(x)).float() * self.scale, y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def _images(self, seed: int) -> DataLoader:
        gen = torch.Generator().manual_seed(seed)
        images = TensorDataset(
            torch.randn(SAMPLES, 3, 8, 8, generator=gen), torch.randint(0, 5, (SAMPLES,), generator=gen)
        )
        return DataLoader(images, batch_size=self.batch_size, shuffle=seed == 0)

    def train_dataloader(self):
        return self._images(0)

    def val_dataloader(self):
        return self._images(1)


class Critic(pl.LightningModule):
    """Manual optimization with two optimizers and two schedulers, GAN-style: the critic learns
    on the encoder's detached features, then the encoder learns through the critic while
    ``toggle_optimizer`` freezes the critic (zero_grad after each step, as Lightning's docs)."""

    def __init__(self, batch_size: int = 6, own_parameter: bool = False):
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.critic = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        self.batch_size = batch_size
        self.offset = nn.Parameter(torch.zeros(3)) if own_parameter else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_encoder, opt_critic = self.optimizers()
        for optimizer, detach in ((opt_critic, True), (opt_encoder, False)):
            self.toggle_optimizer(optimizer)
            features = self.encoder(x)
            loss = nn.functional.mse_loss(self.critic(features.detach() if detach else features), y)
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)
        for schedule in self.lr_schedulers():
            schedule.step()
        return {"loss": loss.detach()}

    def configure_optimizers(self):
        opt_encoder = torch.optim.AdamW(self.encoder.parameters(), lr=0.01)
        opt_critic = torch.optim.SGD(self.critic.parameters(), lr=0.1, momentum=0.9)
        schedules = [
            torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.7) for o in (opt_encoder, opt_critic)
        ]
        return [opt_encoder, opt_critic], schedules

    def train_dataloader(self):
        return DataLoader(dataset(0), batch_size=self.batch_size, shuffle=True)


class Recorder(pl.Callback):
    """Every training batch's loss averaged over the ranks, and whether any optimized tensor held
    a gradient after each backward; rank 0 writes both to ``path``."""

    def __init__(self, path: str):
        self.path = path
        self.losses = []
        self.has_grad = []

    def on_after_backward(self, trainer, pl_module):
        params = [p for o in trainer.optimizers for g in o.param_groups for p in g["params"]]
        self.has_grad.append(any(p.grad is not None for p in params))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(pl_module.all_gather(outputs["loss"].detach()).mean().item())

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump({"losses": self.losses, "has_grad": self.has_grad}, f)


def read_losses(path: str):
    with open(path) as f:
        return json.load(f)["losses"]


def read_has_grad(path: str):
    with open(path) as f:
        return json.load(f)["has_grad"]


def trainer_kwargs(**overrides) -> dict:
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
    }
    return {**quiet, **overrides}


def checkpoint_path(folder: str, epoch: int) -> str:
    return os.path.join(folder, f"epoch={epoch}.ckpt")


class SSLClient(pl.LightningModule):
    """What lightly's SwAV / DINO examples do around the forward: prototype rows normalised in
    place at the start of each step, an EMA teacher updated by zipping ``parameters()``, the
    prototypes' gradients dropped (``p.grad = None``) in the first epoch; BatchNorm in the body
    (synced when the Trainer says ``sync_batchnorm=True``)."""

    def __init__(self, batch_size: int = 6):
        super().__init__()
        self.batch_size = batch_size
        # no bias before BatchNorm: its gradient would be rounding noise, which AdamW amplifies
        body = [nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 16)]
        self.student = nn.Sequential(*body)
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)
        self.prototypes = nn.Linear(16, 10, bias=False)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():  # SwAVPrototypes.normalize(): in place, on the weight
            w = self.prototypes.weight
            w.div_(w.norm(dim=1, keepdim=True))
        x, _ = batch
        scores = self.prototypes(nn.functional.normalize(self.student(x), dim=1)) / 0.1
        with torch.no_grad():
            target = self.prototypes(nn.functional.normalize(self.teacher(x), dim=1)).div(0.05).softmax(1)
        loss = -(target * scores.log_softmax(1)).sum(1).mean()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_after_backward(self):
        if self.current_epoch == 0:  # DINO: the last layer frozen in the first epoch
            for p in self.prototypes.parameters():
                p.grad = None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.mul_(0.9).add_(s.detach(), alpha=0.1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.04)

    def train_dataloader(self):
        return DataLoader(dataset(0), batch_size=self.batch_size, shuffle=True)


class MAEClient(pl.LightningModule):
    """lightly's MAE example, small, with nothing added for sharding: the encoder called by name
    (``self.backbone.encode(images=..., idx_keep=...)`` on lightly's
    ``MaskedVisionTransformerTorchvision``), the decoder's ``embed``, ``decode`` and ``predict``
    (lightly's ``MAEDecoder``), the mask token on the module, MSE on the masked patches."""

    def __init__(self, batch_size: int = 4):
        super().__init__()
        vit = VisionTransformer(
            image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
        )
        decoder_dim = 8
        self.batch_size, self.patch_size, self.sequence_length = batch_size, vit.patch_size, vit.seq_length
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.backbone = MaskedVisionTransformerTorchvision(vit=vit)
        self.decoder = MAEDecoder(
            seq_length=vit.seq_length, num_layers=1, num_heads=2, embed_input_dim=vit.hidden_dim,
            hidden_dim=decoder_dim, mlp_dim=4 * decoder_dim, out_dim=vit.patch_size**2 * 3,
        )  # fmt: skip
        self.criterion = nn.MSELoss()

    def forward_encoder(self, images, idx_keep=None):
        return self.backbone.encode(images=images, idx_keep=idx_keep)

    def forward_decoder(self, x_encoded, idx_keep, idx_mask):
        x_decode = self.decoder.embed(x_encoded)
        x_masked = utils.repeat_token(self.mask_token, (x_encoded.shape[0], self.sequence_length))
        x_masked = utils.set_at_index(x_masked, idx_keep, x_decode.type_as(x_masked))
        x_decoded = self.decoder.decode(x_masked)
        return self.decoder.predict(utils.get_at_index(x_decoded, idx_mask))

    def training_step(self, batch, batch_idx):
        images = batch[0]
        idx_keep, idx_mask = utils.random_token_mask(
            size=(images.shape[0], self.sequence_length), mask_ratio=0.75, device=images.device
        )
        x_pred = self.forward_decoder(self.forward_encoder(images, idx_keep), idx_keep, idx_mask)
        target = utils.get_at_index(utils.patchify(images, self.patch_size), idx_mask - 1)
        loss = self.criterion(x_pred, target)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        images = torch.randn(16, 3, 16, 16, generator=g)
        return DataLoader(TensorDataset(images, torch.zeros(16)), batch_size=self.batch_size, shuffle=True)
