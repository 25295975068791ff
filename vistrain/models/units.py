"""Which modules of the SSL models form a sharded unit or an activation checkpoint.

Plain tables of module classes (the models hold no distributed code): the sharding transform
(``vistrain.runtime.sharding``) turns them into the engine's wrap policy and the planner
(``vistrain.planner``) counts the same units. The trunks' classes come from the trunk registry
(each family declares its own; a class occurs only in its family's models), the head MLPs' are
here, and a head's full-precision units come from its method (``vistrain.methods.fp32_units``).
"""

from typing import Dict, Optional, Sequence, Tuple, Type

from torch import nn

from vistrain.models.heads.mlp import MLP
from vistrain.models.trunks import TRUNKS
from vistrain.models.trunks.library import LibraryTrunk
from vistrain.torch_compat import BatchNormBase

GRANULARITIES = ("block", "stage", "model")


def _trunk_classes(table: str, granularity: str) -> Tuple[Type[nn.Module], ...]:
    """The classes every trunk family lists under ``table`` ("units" or "checkpointed")."""
    classes = [cls for fam in TRUNKS.values() for cls in getattr(fam, table).get(granularity, ())]
    return tuple(dict.fromkeys(classes))


# MODEL.ACTIVATION_CHECKPOINTING.GRANULARITY -> the modules recomputed in backward (RegNet,
# ResNet blocks, ViT encoder blocks; RegNet and ResNet stages)
CHECKPOINTED = {g: _trunk_classes("checkpointed", g) for g in ("block", "stage")}


def model_blocks(model: Optional[nn.Module], granularity: str) -> Tuple[Type[nn.Module], ...]:
    """The block classes the library trunks inside ``model`` found in their models (timm's,
    torchvision's: ``LibraryTrunk.block_classes``); () for a built-in trunk or no model."""
    if model is None:
        return ()
    found = [
        cls
        for module in model.modules()
        if isinstance(module, LibraryTrunk)
        for cls in module.block_classes(granularity)
    ]
    return tuple(dict.fromkeys(found))


def checkpointed_classes(model: Optional[nn.Module], granularity: str) -> Tuple[Type[nn.Module], ...]:
    """The classes recomputed in backward at ``granularity``: the built-in families' table plus
    the blocks of ``model``'s library trunks."""
    return tuple(dict.fromkeys((*CHECKPOINTED.get(granularity, ()), *model_blocks(model, granularity))))


# A convolution or linear layer with at least this many weights (64 MiB in fp32) is its own unit
# inside its block: a unit's full weights and full gradient are alive together in backward, so
# the largest unit sets the peak (RegNetY-128GF's last block holds 154M weights, 588 MiB).
LARGE_LAYER_PARAMS = 2**24


def unit_classes(
    fp32_batchnorm: bool,
    granularity: str = "block",
    fp32_units: Sequence[Type[nn.Module]] = (),
    model: Optional[nn.Module] = None,
) -> Dict[Type[nn.Module], dict]:
    """Module class -> unit options (``keep_fp32``) of the SSL wrap policy.

    ``granularity`` (``MODEL.FSDP_CONFIG.wrap_granularity``): "block" makes every trunk block
    (RegNet: and the stem; ViT: encoder block) and each head MLP a unit; "stage" every stage
    instead of its blocks (a ViT has none: its blocks); "model" none of
    them (the root holds them: one gather and one reduction per step). Fewer, larger units mean
    fewer collectives and more weights gathered at once; the numbers are the same. The fp32 units
    stay units at every granularity: ``fp32_units``, the classes the run's head names (e.g. SwAV's
    prototypes, re-normalised after every step, which feed Sinkhorn's exp(score / eps); DINO's
    weight-normalised last layer, frozen during the first epoch), and BatchNorm under low precision.
    ``model``: the built model, whose library trunks (timm, torchvision) add the block classes
    they found in their models (:func:`model_blocks`).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"wrap granularity must be one of {GRANULARITIES}, got {granularity!r}")
    structure: Dict[str, Tuple[type, ...]] = {
        g: (*_trunk_classes("units", g), *model_blocks(model, g), MLP) for g in ("block", "stage")
    }
    classes = {cls: {} for cls in structure.get(granularity, ())}
    for cls in fp32_units:
        classes[cls] = {"keep_fp32": True}
    if fp32_batchnorm:
        classes[BatchNormBase] = {"keep_fp32": True}
    return classes


def is_large_layer(module: nn.Module) -> bool:
    """A convolution or linear layer of at least ``LARGE_LAYER_PARAMS`` weights. Not the output
    projection of ``nn.MultiheadAttention`` (a ViT's): attention reads its weights without calling
    it, so as a unit of its own they would never be gathered."""
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return False
    layer = isinstance(module, (nn.Conv2d, nn.Linear))
    return layer and sum(p.numel() for p in module.parameters()) >= LARGE_LAYER_PARAMS
