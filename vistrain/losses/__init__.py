"""Losses and their trainer-facing adapters: ``build_loss(cfg.LOSS)`` -> SSLCriterion.

The losses (SimCLRLoss, SwAVLoss, sinkhorn_knopp) work on plain tensors, in one process or under
torch.distributed. The criteria adapt them to SSLModel outputs and own the method's state
(SwAV queue, prototype freezing and normalisation), called explicitly by the training loop:

    loss = criterion(model(crops), num_crops)
    loss.backward()
    criterion.before_optimizer_step(model, iteration)   # drops frozen_params' gradients
    optimizer.step()
    criterion.after_optimizer_step(model)

With the optimizer step inside backward the loop hands ``frozen_params(model, iteration)`` to the
engine before backward instead, and calls ``after_optimizer_step`` once backward returns.
"""

from typing import List

import torch
from torch import nn

from vistrain.fsdp import gathered, params_of
from vistrain.losses.simclr import SimCLRLoss
from vistrain.losses.swav import SwAVLoss, sinkhorn_knopp
from vistrain.models.heads.swav import SwAVPrototypes


class SSLCriterion(nn.Module):
    """Base adapter: ``forward(model_output, num_crops) -> scalar``; hooks are no-ops here."""

    def set_epoch(self, epoch: int) -> None:
        """Called at the start of every epoch."""

    def frozen_params(self, model: nn.Module, iteration: int) -> List[nn.Parameter]:
        """Parameters the optimizer must leave alone at this iteration (none by default)."""
        return []

    def before_optimizer_step(self, model: nn.Module, iteration: int) -> None:
        """Called after backward, before ``optimizer.step()``: frozen parameters lose their
        gradients, so the optimizer skips them (no momentum or weight decay either)."""
        for param in self.frozen_params(model, iteration):
            param.grad = None

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Called right after ``optimizer.step()``."""


class SimCLRCriterion(SSLCriterion):
    """SimCLR on an (2N, D) embedding tensor: rows [0, N) are view 1, [N, 2N) view 2."""

    def __init__(self, simclr_cfg):
        super().__init__()
        self.loss = SimCLRLoss(simclr_cfg.temperature)

    def forward(self, model_output: torch.Tensor, num_crops: int) -> torch.Tensor:
        if num_crops != 2:
            raise ValueError(f"simclr_loss needs exactly 2 crops per image, got {num_crops}")
        if not isinstance(model_output, torch.Tensor) or model_output.shape[0] % 2:
            raise ValueError("simclr_loss expects a (2N, D) embedding tensor from a simclr head")
        z1, z2 = model_output.chunk(2)
        return self.loss(z1, z2)


class SwAVCriterion(SSLCriterion):
    """SwAV on ``(embedding (C*N, D), [scores (C*N, K_j)])``: rows [c*N, (c+1)*N) are crop c.

    Prototype state goes through ``vistrain.fsdp.params_of`` / ``gathered`` so it also works
    when the prototypes are sharded. After every step the normalised prototypes are copied
    (only when a queue is configured) to score queued embeddings in the next forward; until the
    first ``after_optimizer_step`` (fresh start or resume) the queue is filled but not used.
    The queue itself is per rank and part of ``state_dict()`` (``loss._extra_state``).
    """

    def __init__(self, swav_cfg):
        super().__init__()
        self.loss = SwAVLoss(
            temperature=swav_cfg.temperature,
            epsilon=swav_cfg.epsilon,
            sinkhorn_iterations=swav_cfg.sinkhorn_iterations,
            crops_for_assign=swav_cfg.crops_for_assign,
            queue_length=swav_cfg.queue_length,
            start_queue_at_epoch=swav_cfg.start_queue_at_epoch,
        )
        self.freeze_prototypes_niters = swav_cfg.freeze_prototypes_niters
        self.prototype_weights = None  # List[(K_j, D)] after the last step, for the queue

    def forward(self, model_output, num_crops: int) -> torch.Tensor:
        if not isinstance(model_output, (tuple, list)) or len(model_output) != 2:
            raise ValueError("swav_loss expects (embedding, [scores]) from a swav head")
        embedding, scores = model_output
        if embedding.shape[0] % num_crops:
            raise ValueError(f"{embedding.shape[0]} rows do not split into {num_crops} equal crops")
        per_layer = [list(s.chunk(num_crops)) for s in scores]
        embeddings = list(embedding.chunk(num_crops)) if self.loss.queue_active else None
        return self.loss(per_layer, embeddings, self.prototype_weights)

    def set_epoch(self, epoch: int) -> None:
        self.loss.set_epoch(epoch)

    def frozen_params(self, model: nn.Module, iteration: int) -> List[nn.Parameter]:
        """SwAV: "freeze the prototypes during the first epoch" (their parameters, or shards)."""
        if iteration >= self.freeze_prototypes_niters:
            return []
        return [param for module in _prototype_modules(model) for param in params_of(module)]

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Project the prototypes back onto the unit sphere (and keep a copy for the queue)."""

        weights = []
        for module in _prototype_modules(model):
            with gathered(module):
                module.normalize_()
                if self.loss.queue_length > 0:
                    weights.append(module.weight.detach().clone())
        self.prototype_weights = weights or None


def _prototype_modules(model: nn.Module) -> List[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, SwAVPrototypes)]
    if not found:
        raise ValueError("swav_loss needs a model with a swav head (no SwAVPrototypes module found)")
    return found


LOSSES = {"simclr_loss": SimCLRCriterion, "swav_loss": SwAVCriterion}


def build_loss(loss_cfg) -> SSLCriterion:
    """Criterion for ``cfg.LOSS``: NAME picks the class, which reads only ``cfg.LOSS[NAME]``."""
    if loss_cfg.NAME not in LOSSES:
        raise ValueError(f"unknown LOSS.NAME {loss_cfg.NAME!r}; valid names: {sorted(LOSSES)}")
    return LOSSES[loss_cfg.NAME](loss_cfg[loss_cfg.NAME])


__all__ = [
    "LOSSES",
    "SSLCriterion",
    "SimCLRCriterion",
    "SimCLRLoss",
    "SwAVCriterion",
    "SwAVLoss",
    "build_loss",
    "sinkhorn_knopp",
]
