"""Optimizers (SGD, LARS, AdamW) with parameter groups, learning-rate and weight-decay
schedules, gradient clipping.

Usage (the trainer)::

    optimizer = build_optimizer(cfg.OPTIMIZER, model)          # plain, DDP or sharded model
    schedules = build_schedules(cfg.OPTIMIZER, len(loader), global_batch)  # images per step
    lr = schedules.apply(optimizer, iteration)                 # every iteration, before step()
    clip_gradients(model, max_norm, per_parameter)             # after backward, before step()
"""

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from vistrain.optim.clipping import clip_gradients
from vistrain.optim.lars import LARS
from vistrain.optim.param_groups import LayerOf, build_param_groups, param_group_key
from vistrain.optim.schedulers import (
    ParamSchedules,
    build_lr_schedule,
    build_schedules,
    lr_scaling_note,
    set_lr,
    set_weight_decay,
)

__all__ = [
    "LARS",
    "ParamSchedules",
    "build_lr_schedule",
    "build_optimizer",
    "build_schedules",
    "clip_gradients",
    "lr_scaling_note",
    "param_group_key",
    "set_lr",
    "set_weight_decay",
]


def _sgd(groups: List[dict], opt_cfg, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=opt_cfg.momentum, nesterov=opt_cfg.nesterov)


def _lars(groups: List[dict], opt_cfg, lr: float) -> torch.optim.Optimizer:
    return LARS(groups, lr=lr, momentum=opt_cfg.momentum, eta=opt_cfg.lars_eta, nesterov=opt_cfg.nesterov)


def _adamw(groups: List[dict], opt_cfg, lr: float) -> torch.optim.Optimizer:
    if len(opt_cfg.betas) != 2:
        raise ValueError(f"OPTIMIZER.betas must hold two numbers, got {opt_cfg.betas}")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(float(b) for b in opt_cfg.betas))


# name -> builder(param groups, cfg.OPTIMIZER, initial lr). Weight decay comes from the groups.
OPTIMIZERS: Dict[str, Callable] = {"sgd": _sgd, "lars": _lars, "adamw": _adamw}


def build_optimizer(opt_cfg, model: nn.Module, layer_of: Optional[LayerOf] = None) -> torch.optim.Optimizer:
    """The optimizer named ``opt_cfg.name`` over ``model``'s trainable parameters.

    Groups come from :func:`build_param_groups` (per-group ``weight_decay`` and ``lr_multiplier``;
    ``lars_exclude`` for LARS; a group per layer of ``layer_of`` under ``layer_decay``). Every group
    starts at ``base_value * lr_multiplier``; the trainer then calls :func:`set_lr` with the
    schedule each iteration.
    """
    if opt_cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{opt_cfg.name}'; valid: {sorted(OPTIMIZERS)}")
    groups = build_param_groups(opt_cfg, model, layer_of)
    base_lr = float(opt_cfg.param_schedulers.lr.base_value)
    for group in groups:
        group["lr"] = base_lr * group["lr_multiplier"]
    return OPTIMIZERS[opt_cfg.name](groups, opt_cfg, base_lr)
