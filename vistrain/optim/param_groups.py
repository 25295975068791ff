"""Parameter groups: which parameters get weight decay, a head learning-rate multiplier, LARS,
a layer-wise learning-rate decay, and a learning rate fixed at the schedule's peak.

A parameter's group is decided from its clean name (fqn, relative to the root model) and its owning
module, so the same rule classifies plain, DDP and sharded models alike: under ``vistrain.fsdp``
every original parameter stays a parameter of its module (this rank's part of it), under the
unwrapped model's name.

Layer-wise lr decay (``OPTIMIZER.layer_decay`` = d < 1; BEiT, Bao et al. 2022; MAE's fine-tuning):
a parameter of layer l of a model of L layers trains at ``lr * d ** (L - l)``, so the layers near
the input, whose pretrained features are the most general, move the least. Which layer a parameter
is in, the model says (``layer_of(fqn) -> (l, L)``, e.g. a ViT's blocks); each layer is a group.

Fixed lr (``OPTIMIZER.fixed_lr_params``: name prefixes): those parameters train at the schedule's
peak lr (``base_value``, scaled) at every step, without warm-up or decay (SimSiam's predictor,
``--fix-pred-lr``); their group carries ``fixed_lr: True`` and ``set_lr`` gives it the peak.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.fsdp import unwrap
from vistrain.fsdp.ownership import clean_name
from vistrain.torch_compat import NormBase

# Norm layers whose affine parameters follow ``regularize_bn``; NormBase covers every BatchNorm,
# SyncBatchNorm (ours too) and InstanceNorm.
_NORM_TYPES: Tuple[type, ...] = tuple(
    t for t in (NormBase, nn.GroupNorm, nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None
)


@dataclass(frozen=True)
class GroupTraits:
    """What the optimizer needs to know about one group of parameters."""

    head: bool  # under the model's ``head`` with head_lr_multiplier != 1
    decay: bool  # receives weight decay
    lars_exclude: bool  # LARS: plain SGD (no trust ratio)
    layer: Optional[Tuple[int, int]] = None  # (l, L) under layer-wise lr decay, else None
    fixed: bool = False  # under OPTIMIZER.fixed_lr_params: the schedule's peak lr throughout

    @property
    def key(self) -> str:
        """e.g. ``decay``, ``no_decay``, ``head_decay``, ``no_decay_lars_exclude``, ``decay_layer3``."""
        parts = (["head"] if self.head else []) + ["decay" if self.decay else "no_decay"]
        parts += ["lars_exclude"] if self.lars_exclude else []
        parts += ["fixed_lr"] if self.fixed else []
        return "_".join(parts + ([f"layer{self.layer[0]}"] if self.layer is not None else []))

    def options(self, opt_cfg) -> dict:
        """Per-group optimizer options: weight_decay, lr_multiplier (and lars_exclude for LARS)."""
        multiplier = float(opt_cfg.head_lr_multiplier) if self.head else 1.0
        if self.layer is not None:
            layer, layers = self.layer
            multiplier *= float(opt_cfg.layer_decay) ** (layers - layer)
        out = {
            "name": self.key,
            "weight_decay": float(opt_cfg.weight_decay) if self.decay else 0.0,
            "weight_decay_multiplier": 1.0 if self.decay else 0.0,  # of a weight-decay schedule
            "lr_multiplier": multiplier,
        }
        if opt_cfg.name == "lars":
            out["lars_exclude"] = self.lars_exclude
        if self.fixed:
            out["fixed_lr"] = True
        return out


LayerOf = Callable[[str], Tuple[int, int]]  # clean fqn -> (its layer l, the model's layers L), 0 <= l <= L


def classify(fqn: str, module: nn.Module, opt_cfg, layer_of: Optional[LayerOf] = None) -> GroupTraits:
    """Group traits of the original parameter ``fqn`` owned (directly) by ``module``; its layer
    (``layer_of``) counts when ``opt_cfg.layer_decay`` != 1."""
    is_norm = isinstance(module, _NORM_TYPES)
    is_bias = not is_norm and fqn.rsplit(".", 1)[-1] == "bias"
    if is_norm:
        decay = bool(opt_cfg.regularize_bn)
    elif is_bias:
        decay = bool(opt_cfg.regularize_bias)
    else:
        decay = True
    head = fqn.startswith("head.") and float(opt_cfg.head_lr_multiplier) != 1.0
    # Only LARS needs the split; other optimizers would just get more (smaller) flat shards.
    lars_exclude = (
        opt_cfg.name == "lars" and bool(opt_cfg.lars_exclude_bias_and_norm) and (is_norm or is_bias)
    )
    layer = layer_of(fqn) if layer_of is not None and float(opt_cfg.layer_decay) != 1.0 else None
    fixed = any(_under(fqn, prefix) for prefix in opt_cfg.get("fixed_lr_params", ()))
    return GroupTraits(head=head, decay=decay, lars_exclude=lars_exclude, layer=layer, fixed=fixed)


def _under(fqn: str, prefix: str) -> bool:
    """``fqn`` is the parameter ``prefix`` or lies under the module ``prefix``."""
    return fqn == prefix or fqn.startswith(prefix + ".")


def param_group_key(fqn: str, module: nn.Module, param: Optional[torch.Tensor], opt_cfg) -> str:
    """Group name of one ORIGINAL parameter (``param`` may be None; the rules use name and module).

    Args:
        fqn: clean name relative to the root model, e.g. ``trunk.stem.1.weight``, ``head.0.bias``.
        module: the module that owns the parameter directly (``fqn`` minus its last component).
        param: the parameter itself (unused by the current rules; kept for richer rules).
        opt_cfg: ``cfg.OPTIMIZER``.
    Returns:
        ``[head_](decay|no_decay)[_lars_exclude]``: norm parameters decay only when
        ``regularize_bn``, biases only when ``regularize_bias``; ``head_`` when ``fqn`` starts with
        ``head.`` and ``head_lr_multiplier != 1``; ``_lars_exclude`` for biases and norm parameters
        under LARS with ``lars_exclude_bias_and_norm``.
    """
    del param
    return classify(fqn, module, opt_cfg).key


def _iter_owned_params(model: nn.Module) -> Iterator[Tuple[str, nn.Module, nn.Parameter]]:
    """(fqn, owning module, param) for every distinct parameter, in ``named_parameters`` order."""
    seen = set()
    for module_name, module in unwrap(model).named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield clean_name(f"{module_name}.{name}" if module_name else name), module, param


def build_param_groups(opt_cfg, model: nn.Module, layer_of: Optional[LayerOf] = None) -> List[dict]:
    """torch.optim parameter groups for ``model`` (plain, DDP-wrapped or sharded by vistrain.fsdp).

    Returns dicts ``{"params", "name", "weight_decay", "weight_decay_multiplier", "lr_multiplier"[,
    "lars_exclude"][, "fixed_lr"]}`` in order of first appearance; parameters with
    ``requires_grad=False`` are skipped and empty groups are dropped. With ``opt_cfg.layer_decay``
    != 1 every layer of ``layer_of`` is a group of its own (lr_multiplier ``layer_decay ** (L -
    l)``). Raises ValueError when nothing is trainable, or for a layer decay without ``layer_of``;
    ConfigError for a ``fixed_lr_params`` prefix that names no trainable parameter.
    """
    if float(opt_cfg.layer_decay) != 1.0 and layer_of is None:
        raise ValueError(
            "OPTIMIZER.layer_decay needs a model that names its layers (JOB finetune); set it to 1.0"
        )
    groups: Dict[str, Tuple[GroupTraits, List[nn.Parameter]]] = {}
    trainable: List[str] = []
    for fqn, module, param in _iter_owned_params(model):
        if not param.requires_grad:
            continue
        trainable.append(fqn)
        traits = classify(fqn, module, opt_cfg, layer_of)
        groups.setdefault(traits.key, (traits, []))[1].append(param)
    if not groups:
        raise ValueError("model has no trainable parameters (all have requires_grad=False)")
    _check_fixed(opt_cfg, trainable)
    return [dict(params=params, **traits.options(opt_cfg)) for traits, params in groups.values()]


def _check_fixed(opt_cfg, names: List[str]) -> None:
    for prefix in opt_cfg.get("fixed_lr_params", ()):
        if not any(_under(fqn, prefix) for fqn in names):
            near = sorted({".".join(fqn.split(".")[:2]) for fqn in names if fqn.startswith("head.")})
            raise ConfigError(
                f"OPTIMIZER.fixed_lr_params: {prefix!r} names no trainable parameter of the model "
                f"(a module or parameter name, e.g. {', '.join(near) or 'head'})"
            )
