"""Weights from any of our checkpoint formats, or a library's, into a plain model (fine-tuning,
linear eval, pretraining from weights).

``MODEL.WEIGHTS_INIT.PARAMS_FILE`` may name

* a sharded checkpoint folder (``.../checkpoint_<n>``, with ``metadata.json``),
* a run folder (its latest complete checkpoint is used),
* a ``.pt`` / ``.pth`` / ``.bin`` torch file: a state dict, or a dict holding one under a key one
  level down (``{"model": sd}``, ``{"state_dict": sd}``, ``{"model_state": sd, "epoch": 3}``...;
  :func:`state_dict_of`), what ``tools/convert_checkpoint.py --to-consolidated`` writes or any
  library saves,
* a ``.safetensors`` file (the ``safetensors`` package: ``pip install -e ".[safetensors]"``).

Checkpoint key -> model key: strip ``REMOVE_PREFIX`` (keys without it stay as they are), then
prepend ``APPEND_PREFIX``; with both empty the pair is found by matching the keys
(``key_map.find_key_map``: ``module.``, ``backbone.``, a bare trunk's keys into ``trunk.``...).
Keys containing any ``SKIP_LAYERS`` substring (checked on the mapped key) are not loaded. A shape
mismatch, no matching key, or trunk keys the checkpoint lacks (another model) are one-line errors;
missing head keys, unexpected keys and the checkpoint's classifier (``fc.``, ``head.``...) are
reported. ``only_prefix`` reads one network of a checkpoint that holds several (the momentum
teacher's keys start with ``teacher.``): the other keys are not looked at.
"""

import functools
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from vistrain.checkpoint.files import (
    METADATA,
    CheckpointError,
    check_readable,
    find_latest_checkpoint,
    safe_load,
)
from vistrain.checkpoint.input_conv import adapt_input_conv, adaptable, first_conv_weight
from vistrain.checkpoint.key_map import (
    KeyMap,
    find_key_map,
    first,
    missing_trunk_error,
    no_match_error,
    trunk_missing,
)
from vistrain.checkpoint.load import SliceReader
from vistrain.checkpoint.safetensors_file import SafetensorsFile, is_safetensors
from vistrain.checkpoint.tensor_file import TensorFile
from vistrain.config.words import plural
from vistrain.fsdp.deferred_init import defer_value

logger = logging.getLogger("vistrain")


class WeightsSource:
    """Keys, shapes, dtypes and tensors of a checkpoint, read one tensor at a time.

    Opening reads only the structure (metadata.json, the pickled part of a torch file, or a
    safetensors header); :meth:`read` then reads the bytes of one tensor (from the rank files
    holding its slices), so the process never holds more of the checkpoint than the tensor asked
    for. ``reader``: the sharded checkpoint's (None for a file); ``file``: the file's
    (:class:`TorchStateFile` or ``SafetensorsFile``; None for a sharded checkpoint).
    """

    def __init__(self, path: str):
        self.path = resolve_weights_path(path)
        self.reader = None
        self.file = None
        if os.path.isdir(self.path):
            self.reader = SliceReader(self.path)
        elif is_safetensors(self.path):
            self.file = SafetensorsFile(self.path)
        else:
            self.file = TorchStateFile(self.path)

    def shapes(self) -> "OrderedDict[str, Tuple[int, ...]]":
        return OrderedDict((k, shape) for k, (shape, _) in self.specs().items())

    def specs(self) -> "OrderedDict[str, Tuple[Tuple[int, ...], torch.dtype]]":
        """key -> (shape, dtype), parameters then buffers, in the checkpoint's order."""
        if self.reader is None:
            return self.file.specs()
        meta = self.reader.meta
        entries = list(meta["params"].items()) + list(meta["buffers"].items())
        return OrderedDict((k, (tuple(v["shape"]), getattr(torch, v["dtype"]))) for k, v in entries)

    def read(self, key: str) -> torch.Tensor:
        """A tensor of its own, read from the file(s) now."""
        if self.reader is None:
            return self.file.read(key)
        if key in self.reader.meta["params"]:
            return self.reader.read_param(key)
        return self.reader.read_buffer(key)


class TorchStateFile:
    """The state dict in a ``torch.save`` file (:func:`state_dict_of`), one tensor read at a time;
    ``nested``: the key it was found under ("" at the top)."""

    def __init__(self, path: str):
        self.path = path
        self._file = TensorFile(path)
        self._state, self.nested = state_dict_of(self._file.obj, path)  # meta tensors

    def specs(self) -> "OrderedDict[str, Tuple[Tuple[int, ...], torch.dtype]]":
        return OrderedDict((k, (tuple(v.shape), v.dtype)) for k, v in self._state.items())

    def read(self, key: str) -> torch.Tensor:
        return self._file.tensor(self._state[key])


def check_weights_file(path: str) -> None:
    """Raise CheckpointError / FileNotFoundError (one line) unless ``path`` (a torch or safetensors
    file, a checkpoint folder or a run folder) resolves to files that open and hold a state dict.
    Memory-mapped: cheap."""
    path = resolve_weights_path(path)
    if os.path.isdir(path):
        check_readable(path)
    elif is_safetensors(path):
        SafetensorsFile(path)
    else:
        state_dict_of(safe_load(path), path)


def resolve_weights_path(path: str) -> str:
    """A checkpoint folder or file for ``path`` (a run folder gives its latest checkpoint)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, METADATA)):
            return path
        unreadable: List[Tuple[str, str]] = []
        latest = find_latest_checkpoint(path, unreadable)
        for _, reason in unreadable:
            logger.warning(f"skipping unreadable checkpoint: {reason}")
        if latest is None:
            raise CheckpointError(f"{path}: holds no complete checkpoint (no checkpoint_<n>/{METADATA})")
        return latest
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights file {path} does not exist")
    return path


# keys a training script saves its model's state dict under, tried in this order
NESTED_NAMES = (
    "model",
    "state_dict",
    "model_state",
    "model_state_dict",
    "module",
    "net",
    "network",
    "weights",
)


def state_dict_of(obj, path: str) -> Tuple[Dict[str, torch.Tensor], str]:
    """(the state dict in ``obj``, the key it was under: "" for ``obj`` itself).

    ``obj``: what a torch file holds. A dict of tensors is the state dict; otherwise a dict whose
    value under one of :data:`NESTED_NAMES` (or, failing those, its only value) is a dict of
    tensors holds it. CheckpointError (one line) when there is none, or several to choose from.
    """
    if _is_state_dict(obj):
        return obj, ""
    nested = {k: v for k, v in obj.items() if _is_state_dict(v)} if isinstance(obj, dict) else {}
    name = next((n for n in NESTED_NAMES if n in nested), None)
    if name is None and len(nested) == 1:
        name = next(iter(nested))
    if name is not None:
        return nested[name], name
    if nested:
        raise CheckpointError(
            f"{path}: holds {len(nested)} state dicts ({first(list(nested))}), none under "
            f"{NESTED_NAMES[0]!r} or {NESTED_NAMES[1]!r}: save the one to load by itself"
        )
    what = f"a dict of {first([str(k) for k in obj])}" if isinstance(obj, dict) else type(obj).__name__
    raise CheckpointError(
        f"{path}: not a state dict (found {what}; expected {{name: tensor}}, or such a dict one level "
        "down, e.g. under 'model' or 'state_dict')"
    )


def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(torch.is_tensor(v) for v in obj.values())


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did."""

    source: str
    key_map: Optional[KeyMap] = None  # how checkpoint keys were mapped onto model keys
    loaded: List[str] = field(default_factory=list)  # model keys
    missing: List[str] = field(default_factory=list)  # model keys left at their initial values
    unexpected: List[str] = field(default_factory=list)  # mapped checkpoint keys the model lacks
    classifier: List[str] = field(default_factory=list)  # those of the checkpoint's classifier
    skipped: List[str] = field(default_factory=list)  # mapped checkpoint keys matching SKIP_LAYERS

    def summary(self) -> str:
        lines = [f"weights from {self.source}: {plural(len(self.loaded), 'tensor')} loaded"]
        if self.key_map is not None and (self.key_map.remove or self.key_map.append):
            lines[0] += f", keys mapped with {self.key_map.describe()}"
        for name, keys in (
            ("missing (kept at init)", self.missing),
            ("unexpected (ignored)", self.unexpected),
            ("the checkpoint's classifier (ignored)", self.classifier),
            ("skipped (SKIP_LAYERS)", self.skipped),
        ):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                lines.append(f"  {name}: {shown}")
        return "\n".join(lines)


def _load_targets(model: nn.Module) -> dict:
    """State-dict names -> the model's own parameter and buffer objects."""
    names = set(model.state_dict())
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    return {name: t for name, t in named if name in names}


def _assign(target: torch.Tensor, source: "WeightsSource", key: str, adapt: bool = False) -> None:
    """Copy checkpoint tensor ``key`` into ``target`` (``adapt``: RGB kernels adapted to the
    target's input channels, ``input_conv.adapt_input_conv``); a meta target (per-unit
    initialisation) instead records the read, done when the sharded engine creates the target's unit."""
    channels = target.shape[1] if adapt else 0
    if target.is_meta:
        defer_value(target, functools.partial(_read_as, source, key, target.dtype, channels))
    else:
        target.copy_(_read_as(source, key, target.dtype, channels))


def _read_as(source: "WeightsSource", key: str, dtype: torch.dtype, channels: int = 0) -> torch.Tensor:
    tensor = source.read(key)
    return (adapt_input_conv(tensor, channels) if channels else tensor).to(dtype)


@torch.no_grad()
def load_pretrained(model: nn.Module, weights_cfg, only_prefix: str = "") -> LoadReport:
    """Copy the weights named by ``weights_cfg`` (``cfg.MODEL.WEIGHTS_INIT``) into ``model``.

    ``model`` is the plain (unwrapped) module; every rank calls this before wrapping. Reads one
    tensor at a time (:class:`WeightsSource`), whatever the checkpoint's form. On a model built
    on the meta device (per-unit initialisation) each read is deferred to the moment the sharded
    engine creates that tensor's unit, so a rank holds at most one unit's weights. Raises
    CheckpointError (one line) on a shape mismatch (file, key, both shapes), when no key matches
    or when trunk keys stay missing (keys on both sides and the fix), FileNotFoundError for a
    missing path; logs and returns a :class:`LoadReport`. ``only_prefix``: read only the
    checkpoint keys that start with it (CheckpointError when none does).
    """
    source = WeightsSource(weights_cfg.PARAMS_FILE)
    targets = _load_targets(model)
    shapes = {key: shape for key, shape in source.shapes().items() if key.startswith(only_prefix)}
    if only_prefix and not shapes:
        raise CheckpointError(f"{source.path}: holds no key starting with {only_prefix!r}")
    key_map = _key_map(weights_cfg, shapes, targets)
    report = LoadReport(source.path, key_map)
    first_conv = first_conv_weight(model)
    for key, shape in shapes.items():
        name = key_map(key)
        if any(s in name for s in weights_cfg.SKIP_LAYERS):
            report.skipped.append(name)
        elif name not in targets:
            (report.classifier if key_map.is_classifier(key) else report.unexpected).append(name)
        elif name == first_conv and adaptable(shape, targets[name].shape):
            _assign(targets[name], source, key, adapt=True)
            report.loaded.append(name)
            channels = targets[name].shape[1]
            how = "summed over R, G, B" if channels == 1 else f"repeated R, G, B and scaled by 3/{channels}"
            logger.info(
                f"{name}: the checkpoint's RGB kernels adapted to {channels} input channels ({how}, as timm does)"
            )
        elif tuple(targets[name].shape) != tuple(shape):
            raise CheckpointError(
                f"{source.path}: {key} has shape {tuple(shape)} but the model's {name} "
                f"has shape {tuple(targets[name].shape)}"
            )
        else:
            _assign(targets[name], source, key)
            report.loaded.append(name)
    done = set(report.loaded)
    report.missing = [
        k for k in targets if k not in done and not any(s in k for s in weights_cfg.SKIP_LAYERS)
    ]
    if not report.loaded:
        raise no_match_error(source.path, shapes, _shapes(targets), key_map)
    if trunk_missing(report.missing):
        raise missing_trunk_error(source.path, trunk_missing(report.missing), report.unexpected, key_map)
    logger.info(report.summary())
    return report


def _key_map(weights_cfg, shapes: Dict[str, Tuple[int, ...]], targets: dict) -> KeyMap:
    """The configured prefixes, or (both empty) the pair that maps the most keys, logged."""
    if weights_cfg.REMOVE_PREFIX or weights_cfg.APPEND_PREFIX:
        return KeyMap(weights_cfg.REMOVE_PREFIX, weights_cfg.APPEND_PREFIX)
    return find_key_map(shapes, _shapes(targets), weights_cfg.SKIP_LAYERS)


def _shapes(targets: dict) -> Dict[str, Tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in targets.items()}
