"""The model fine-tuning trains: a trunk of ``MODEL.TRUNK`` and a linear head on one of its features.

A plain ``nn.Module`` like every model here: the run shards it with our engine
(``AUTO_SETUP_FSDP``: every trunk block a unit, the head in the root unit) or wraps it in DDP, after
building it (on the meta device for the engine, so that a rank creates one unit at a time) and
loading the pretrained trunk (:mod:`vistrain.benchmarks.weights`; the head is new).
"""

import functools
from typing import Callable, Tuple

import torch
from torch import nn

from vistrain.benchmarks import common
from vistrain.benchmarks.weights import load_weights
from vistrain.config import ConfigError
from vistrain.models.trunks import build_trunk
from vistrain.runtime.sharding import build_for_run


class Classifier(nn.Module):
    """``forward(images (N, 3, H, W)) -> logits (N, num_classes)``: ``head(pool(trunk(x)[f]))``.

    ``feature`` names one trunk feature, optionally ``name@P`` (a map average-pooled to P x P and
    flattened, as the linear probe pools; vectors such as "avgpool" or "cls" as they are). The head
    is ``Linear(D, num_classes)`` initialised N(0, 0.01^2) with a zero bias, as the probe's.
    """

    def __init__(self, trunk: nn.Module, feature: str, pool_size: int, num_classes: int):
        super().__init__()
        self.trunk = trunk
        [(self.feature, self.side)] = common.feature_parts(feature, pool_size)
        vectors = getattr(trunk, "vector_features", ("avgpool",))
        width = common.pooled_dims(trunk.feature_dims, [feature], pool_size, vectors)[feature]
        self.pooled = self.feature not in vectors
        self.head = nn.Linear(width, num_classes)
        nn.init.normal_(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        feature = self.trunk(images)[self.feature]
        if self.pooled:
            feature = common.pool_feature(feature, self.side)
        return self.head(feature)

    def lr_layer(self, fqn: str) -> Tuple[int, int]:
        """(layer l, layers L) of parameter ``fqn`` for layer-wise lr decay (``OPTIMIZER.layer_decay``):
        the trunk's ``lr_layer_of`` (ViT: per block; RegNet, ResNet: per stage), the head at L."""
        layers = self.trunk.num_lr_layers
        if fqn.startswith("trunk."):
            return self.trunk.lr_layer_of(fqn[len("trunk.") :]), layers
        return layers, layers


def classifier_config(cfg):
    """``cfg.MODEL`` with the trunk asked for the fine-tuned feature only."""
    model_cfg = cfg.MODEL.clone()
    model_cfg.defrost()
    [(feature, _)] = common.feature_parts(cfg.BENCHMARK.FINETUNE.FEATURE, 1)
    model_cfg.TRUNK.OUT_FEATURES = [feature]
    model_cfg.freeze()
    return model_cfg


def build_classifier(model_cfg, feature: str, pool_size: int, num_classes: int) -> Classifier:
    return Classifier(build_trunk(model_cfg.TRUNK), feature, pool_size, num_classes)


def build_run_model(cfg, num_classes: int) -> Classifier:
    """The plain classifier of ``cfg`` (on the meta device under our sharded engine) with the
    pretrained trunk of ``MODEL.WEIGHTS_INIT`` loaded (the checkpoint's own head is never read);
    a random trunk without PARAMS_FILE. Seeds torch with SEED_VALUE first, so every
    run of a job starts from the same head and (random) trunk."""
    model_cfg = classifier_config(cfg)
    bench = cfg.BENCHMARK
    build: Callable = functools.partial(
        build_classifier, feature=bench.FINETUNE.FEATURE, pool_size=bench.POOL_SIZE, num_classes=num_classes
    )
    torch.manual_seed(cfg.SEED_VALUE)
    model = build_for_run(build, model_cfg)
    weights = cfg.MODEL.WEIGHTS_INIT.clone()
    weights.defrost()
    weights.SKIP_LAYERS = [*weights.SKIP_LAYERS, "head."]  # the classifier's head is new
    if weights.PARAMS_FILE:  # else the job's header said it once: a random trunk
        load_weights(model, weights, bench.WEIGHTS_FROM)
    return model


def check_feature_trains_the_trunk(cfg) -> None:
    """ConfigError (one line) when the trunk computes BENCHMARK.FINETUNE.FEATURE without some of its
    parameters (a feature of an early stage: the later stages would get no gradient). Runs the
    classifier forward and backward on the meta device: no memory, no arithmetic."""
    model_cfg = classifier_config(cfg)
    with torch.device("meta"):
        model = build_classifier(model_cfg, cfg.BENCHMARK.FINETUNE.FEATURE, cfg.BENCHMARK.POOL_SIZE, 2)
        side = _crop_side(cfg.DATA.TRAIN.TRANSFORMS)
        model(torch.empty(2, 3, side, side)).sum().backward()
    unused = [name for name, param in model.named_parameters() if param.grad is None]
    if unused:
        raise ConfigError(
            f"BENCHMARK.FINETUNE.FEATURE {cfg.BENCHMARK.FINETUNE.FEATURE!r} leaves {len(unused)} trunk "
            f"parameters untrained ({unused[0]}...): fine-tune a feature of the last stage or block "
            "(avgpool, or cls for a ViT)"
        )


def _crop_side(transforms_cfg) -> int:
    return transforms_cfg.SIZE_CROPS[0] if transforms_cfg.NAME == "multicrop" else transforms_cfg.CENTER_CROP


@torch.no_grad()
def view_logits(model: nn.Module, images: torch.Tensor, views: str, dtype=None) -> torch.Tensor:
    """Float32 logits (N, C) of ``images`` (N, 3, H, W) averaged over the transforms of
    ``BENCHMARK.FEATURE_VIEWS`` (``views``): mean_g head(f(g x)) = head(mean_g f(g x)), the linear
    probe's feature averaging, since the head is linear."""
    total = None
    transforms = common.FEATURE_VIEWS[views]
    for turns, flip in transforms:
        with torch.autocast(images.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(common.view_of(images, turns, flip)).float()
        total = logits if total is None else total + logits
    return total / len(transforms)
