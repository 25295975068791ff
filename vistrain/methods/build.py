"""Building what a run's method names: the model with its head, the criterion, and what the
layers above ask about it (the head's fp32 units for the wrap policy)."""

from typing import Optional, Tuple, Type

import torch
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.methods.base import Criterion
from vistrain.methods.configuration import method_problem
from vistrain.methods.registry import head_of, method_of
from vistrain.models import SSLModel, build_ssl_model


def build_head(head_cfg, trunk: Optional[nn.Module] = None) -> nn.Module:
    """The head of ``MODEL.HEAD`` (``HEADS[NAME]``), given the trunk when it is sized by it;
    ValueError listing the names for another."""
    head = head_of(head_cfg)
    if head.sized_by_trunk:
        if trunk is None:
            raise ValueError(f"the {head.name} head is sized by its trunk: build it with build_model")
        return head.build(head_cfg, trunk)
    return head.build(head_cfg)


def build_model(model_cfg) -> SSLModel:
    """Plain (unsharded, undistributed) model for ``cfg.MODEL``: its trunk, then its head.
    ConfigError (one line) for a head that does not fit the trunk or its settings."""
    return build_ssl_model(model_cfg, build_head)


def build_meta_model(model_cfg) -> SSLModel:
    """:func:`build_model` on the meta device: shapes and widths without memory or initialisation
    (the config check, the memory planner)."""
    with torch.device("meta"):
        return build_model(model_cfg)


def fp32_units(model_cfg) -> Tuple[Type[nn.Module], ...]:
    """The module classes of MODEL.HEAD's head that the wrap policy keeps as separate
    full-precision units (``vistrain.models.units.unit_classes``)."""
    return head_of(model_cfg.HEAD).fp32_units


def build_loss(loss_cfg, model_cfg=None) -> Criterion:
    """Criterion for ``cfg.LOSS``: NAME picks the method, whose criterion reads ``cfg.LOSS[NAME]``
    (and ``cfg.MODEL`` where it needs the model's sizes: DINO's head width, MAE's patches)."""
    return method_of(loss_cfg).criterion(loss_cfg[loss_cfg.NAME], model_cfg)


def build_method(cfg) -> Criterion:
    """The criterion of ``cfg``'s method, after its checks (:func:`method_problem`: its head,
    its crops per image, its own checks); ConfigError (one line) when they fail."""
    problem = method_problem(cfg)
    if problem:
        raise ConfigError(problem)
    return build_loss(cfg.LOSS, cfg.MODEL)
