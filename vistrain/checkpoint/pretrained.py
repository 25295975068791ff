"""Weights from any of our checkpoint formats into a plain model (fine-tuning, linear eval).

``MODEL.WEIGHTS_INIT.PARAMS_FILE`` may name

* a sharded checkpoint folder (``.../checkpoint_<n>``, with ``metadata.json``),
* a run folder (its latest complete checkpoint is used),
* a consolidated ``.pt`` file: a plain state dict, or ``{"model": state_dict}``
  (what ``tools/convert_checkpoint.py --to-consolidated`` writes, or any torch state dict).

Checkpoint key -> model key: strip ``REMOVE_PREFIX`` (keys without it stay as they are), then
prepend ``APPEND_PREFIX``; keys containing any ``SKIP_LAYERS`` substring (checked on the mapped
key) are not loaded. A shape mismatch is an error; missing and unexpected keys are reported.
``only_prefix`` reads one network of a checkpoint that holds several (the momentum teacher's keys
start with ``teacher.``): the other keys are not looked at.
"""

import functools
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
from torch import nn

from vistrain.checkpoint.files import (
    METADATA,
    CheckpointError,
    check_readable,
    find_latest_checkpoint,
    safe_load,
)
from vistrain.checkpoint.load import SliceReader
from vistrain.checkpoint.tensor_file import TensorFile
from vistrain.config.words import plural
from vistrain.fsdp.deferred_init import defer_value

logger = logging.getLogger("vistrain")


class WeightsSource:
    """Keys, shapes, dtypes and tensors of a checkpoint, read one tensor at a time.

    Opening reads only the structure (metadata.json, or the pickled part of a ``.pt`` file);
    :meth:`read` then reads the bytes of one tensor (from the rank files holding its slices),
    so the process never holds more of the checkpoint than the tensor asked for.
    """

    def __init__(self, path: str):
        self.path = resolve_weights_path(path)
        self.reader = None
        self._file = None
        self._state: Dict[str, torch.Tensor] = {}  # a .pt file's meta tensors (shape, dtype)
        if os.path.isdir(self.path):
            self.reader = SliceReader(self.path)
        else:
            self._file = TensorFile(self.path)
            self._state = _state_dict_of(self._file.obj, self.path)

    def shapes(self) -> "OrderedDict[str, Tuple[int, ...]]":
        return OrderedDict((k, shape) for k, (shape, _) in self.specs().items())

    def specs(self) -> "OrderedDict[str, Tuple[Tuple[int, ...], torch.dtype]]":
        """key -> (shape, dtype), parameters then buffers, in the checkpoint's order."""
        if self.reader is None:
            return OrderedDict((k, (tuple(v.shape), v.dtype)) for k, v in self._state.items())
        meta = self.reader.meta
        entries = list(meta["params"].items()) + list(meta["buffers"].items())
        return OrderedDict((k, (tuple(v["shape"]), getattr(torch, v["dtype"]))) for k, v in entries)

    def read(self, key: str) -> torch.Tensor:
        """A tensor of its own, read from the file(s) now."""
        if self.reader is None:
            return self._file.tensor(self._state[key])
        if key in self.reader.meta["params"]:
            return self.reader.read_param(key)
        return self.reader.read_buffer(key)


def check_weights_file(path: str) -> None:
    """Raise CheckpointError / FileNotFoundError (one line) unless ``path`` (a ``.pt`` file, a
    checkpoint folder or a run folder) resolves to files that open. Memory-mapped: cheap."""
    path = resolve_weights_path(path)
    if os.path.isdir(path):
        check_readable(path)
    else:
        safe_load(path)


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


def _state_dict_of(obj, path: str) -> Dict[str, torch.Tensor]:
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path}: not a state dict (expected {{name: tensor}} or {{'model': ...}})")
    for key, value in obj.items():
        if not torch.is_tensor(value):
            raise CheckpointError(f"{path}: not a state dict: key {key!r} holds a {type(value).__name__}")
    return obj


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did."""

    source: str
    loaded: List[str] = field(default_factory=list)  # model keys
    missing: List[str] = field(default_factory=list)  # model keys left at their initial values
    unexpected: List[str] = field(default_factory=list)  # mapped checkpoint keys the model lacks
    skipped: List[str] = field(default_factory=list)  # mapped checkpoint keys matching SKIP_LAYERS

    def summary(self) -> str:
        lines = [f"weights from {self.source}: {plural(len(self.loaded), 'tensor')} loaded"]
        for name, keys in (
            ("missing (kept at init)", self.missing),
            ("unexpected (ignored)", self.unexpected),
            ("skipped (SKIP_LAYERS)", self.skipped),
        ):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                lines.append(f"  {name}: {shown}")
        return "\n".join(lines)


def map_key(key: str, remove_prefix: str, append_prefix: str) -> str:
    if remove_prefix and key.startswith(remove_prefix):
        key = key[len(remove_prefix) :]
    return append_prefix + key


def _load_targets(model: nn.Module) -> dict:
    """State-dict names -> the model's own parameter and buffer objects."""
    names = set(model.state_dict())
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    return {name: t for name, t in named if name in names}


def _assign(target: torch.Tensor, source: "WeightsSource", key: str) -> None:
    """Copy checkpoint tensor ``key`` into ``target``; a meta target (per-unit initialisation)
    instead records the read, done when the sharded engine creates the target's unit."""
    if target.is_meta:
        defer_value(target, functools.partial(_read_as, source, key, target.dtype))
    else:
        target.copy_(source.read(key))


def _read_as(source: "WeightsSource", key: str, dtype: torch.dtype) -> torch.Tensor:
    return source.read(key).to(dtype)


@torch.no_grad()
def load_pretrained(model: nn.Module, weights_cfg, only_prefix: str = "") -> LoadReport:
    """Copy the weights named by ``weights_cfg`` (``cfg.MODEL.WEIGHTS_INIT``) into ``model``.

    ``model`` is the plain (unwrapped) module; every rank calls this before wrapping. Reads one
    tensor at a time (:class:`WeightsSource`), whatever the checkpoint's form. On a model built
    on the meta device (per-unit initialisation) each read is deferred to the moment the sharded
    engine creates that tensor's unit, so a rank holds at most one unit's weights. Raises
    CheckpointError (one line: file, key, both shapes) on a shape mismatch, FileNotFoundError for
    a missing path; logs and returns a :class:`LoadReport`. ``only_prefix``: read only the
    checkpoint keys that start with it (CheckpointError when none does).
    """
    source = WeightsSource(weights_cfg.PARAMS_FILE)
    targets = _load_targets(model)
    report = LoadReport(source.path)
    shapes = {key: shape for key, shape in source.shapes().items() if key.startswith(only_prefix)}
    if only_prefix and not shapes:
        raise CheckpointError(f"{source.path}: holds no key starting with {only_prefix!r}")
    for key, shape in shapes.items():
        name = map_key(key, weights_cfg.REMOVE_PREFIX, weights_cfg.APPEND_PREFIX)
        if any(s in name for s in weights_cfg.SKIP_LAYERS):
            report.skipped.append(name)
        elif name not in targets:
            report.unexpected.append(name)
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
        first = next(iter(shapes), None)
        raise CheckpointError(
            f"{source.path}: no key matches the model (checkpoint key {first!r} maps to "
            f"{map_key(str(first), weights_cfg.REMOVE_PREFIX, weights_cfg.APPEND_PREFIX)!r}); "
            "check REMOVE_PREFIX / APPEND_PREFIX / SKIP_LAYERS"
        )
    logger.info(report.summary())
    return report
