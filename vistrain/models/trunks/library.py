"""What the trunks built from another library's models share (``timm_models``, ``torchvision_models``).

Such a trunk holds the library's model unchanged (its parameter names are the library's, so its
weights go in and out in the library's own format) and answers what the rest of vistrain asks
of a trunk: ``feature_dims``, ``out_features``, ``vector_features``, the classes of its repeated
blocks (:meth:`LibraryTrunk.block_classes`: the sharded units and activation checkpoints, found
from the structure by ``structure.repeated_blocks`` or named in the family's ``BLOCKS``), and the
layer of each parameter for fine-tuning's layer-wise lr decay.
"""

import logging
from typing import Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn

from vistrain.models.trunks.family import check_out_features
from vistrain.models.trunks.structure import classes_named, describe_units, repeated_blocks

logger = logging.getLogger("vistrain")


class LibraryTrunk(nn.Module):
    """Base of the library trunks. Subclasses set the model first (``self.<attr> = model``), then
    call :meth:`setup`, and implement ``forward(x) -> {name: feature}``."""

    def setup(
        self,
        model: nn.Module,
        feature_dims: Dict[str, int],
        vector_features: Sequence[str],
        out_features: Sequence[str],
        blocks: Sequence[str],
        what: str,
    ) -> None:
        """``feature_dims``: every feature -> channels; ``vector_features``: the (N, C) ones (the
        others are (N, C, h, w) maps); ``blocks``: class names of the blocks ([]: found from the
        structure); ``what``: the model, for the build's log line."""
        self.feature_dims = dict(feature_dims)
        self.vector_features = list(vector_features)
        self.out_features = check_out_features(out_features, list(self.feature_dims))
        if blocks:
            named = classes_named(model, blocks, "MODEL.TRUNK.<family>.BLOCKS")
            self._blocks = {"block": named, "stage": named}
        else:
            self._blocks = repeated_blocks(model)
        count, self._lr_layers = _lr_layers(self, self._blocks["block"])
        self.num_lr_layers = count + 1
        how = "named by BLOCKS" if blocks else "found from its structure"
        logger.info(
            f"trunk {what}: repeated blocks {how}: {describe_units(model, self._blocks['block'])}"
            f" (wrap_granularity stage: {describe_units(model, self._blocks['stage'])})"
        )

    def block_classes(self, granularity: str) -> Tuple[Type[nn.Module], ...]:
        """The classes of this trunk's blocks ("block") or stages ("stage"): sharded units and
        activation checkpoints."""
        return self._blocks.get(granularity, ())

    def lr_layer_of(self, name: str) -> int:
        """Layer of parameter ``name`` (relative to the trunk) for layer-wise lr decay: block i
        (0-based, in module order) i + 1, parameters before the first block 0, after the last
        one ``num_lr_layers`` (the head's layer)."""
        return self._lr_layers.get(name, 0)


def _lr_layers(trunk: nn.Module, classes: Tuple[Type[nn.Module], ...]) -> Tuple[int, Dict[str, int]]:
    """(number of outermost blocks of ``classes`` in ``trunk``, parameter name -> layer): block i
    (1-based) layer i; a parameter between blocks (a downsampling layer) the preceding block's;
    before the first 0; after the last one the head's, blocks + 1."""
    prefixes: List[str] = []
    for name, module in trunk.named_modules():
        if classes and isinstance(module, classes) and not any(name.startswith(p) for p in prefixes):
            prefixes.append(name + ".")
    names = [name for name, _ in trunk.named_parameters()]
    blocks = [next((i + 1 for i, p in enumerate(prefixes) if n.startswith(p)), None) for n in names]
    last = max((pos for pos, b in enumerate(blocks) if b is not None), default=-1)
    layers, previous = {}, 0
    for pos, (name, block) in enumerate(zip(names, blocks)):
        previous = block if block is not None else previous
        layers[name] = len(prefixes) + 1 if pos > last and last >= 0 else previous
    return len(prefixes), layers


def _plain(value):
    """A config value as plain Python (CfgNode -> dict, recursively)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return list(map(_plain, value)) if isinstance(value, (list, tuple)) else value


def keyword_arguments(section, key: str) -> dict:
    """A ``KWARGS`` mapping of the config as a plain dict; ValueError (one line) for a key without
    a value (YAML reads ``{img_size:32}``, no space after the colon, as the key "img_size:32")."""
    kwargs = _plain(section)
    empty = [name for name, value in kwargs.items() if value is None]
    if empty:
        raise ValueError(
            f"{key}.{empty[0]} has no value: write the mapping with a space after each colon, e.g. "
            "{img_size: 32, drop_path_rate: 0.1}"
        )
    return kwargs


def meta_build(build, *args, **kwargs) -> Optional[nn.Module]:
    """``build(*args, **kwargs)`` on the meta device (shapes only, no memory), or None when the
    library's constructor cannot run there (it computes values on its tensors)."""
    try:
        with torch.device("meta"):
            return build(*args, **kwargs)
    except (NotImplementedError, RuntimeError):
        return None
