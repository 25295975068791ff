"""A trained trunk alone, in the form its library loads (``tools/convert_checkpoint.py``).

* :func:`to_torchvision`: the trunk as the state dict of its torchvision model (the families'
  ``to_torchvision``; RegNet, ResNet, ViT, the ``torchvision`` family), without classifier.
* :func:`to_timm`: the state dict ``timm.create_model(name, num_classes=0, checkpoint_path=OUT)``
  loads (families with ``to_timm``: the ``timm`` family).
* :func:`to_safetensors`: the trunk in its family's library's keys (timm's where the family has
  ``to_timm``, torchvision's otherwise) as a ``.safetensors`` file.

Any of them writes a ``.safetensors`` file when OUT ends so, a ``torch.save`` file otherwise, one
tensor at a time (``save_streamed`` / ``save_safetensors_streamed``). ``teacher=True`` exports
the momentum teacher's trunk (keys ``teacher.trunk.``). The family comes from the run folder's
``config.yaml`` (``MODEL.TRUNK.NAME``; a checkpoint folder's run folder is its parent); without
one, from the first trunk key (each family's ``torchvision_prefixes``). The model card beside
the file: ``model_card.py``.
"""

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Tuple

from vistrain.checkpoint.files import METADATA, CheckpointError
from vistrain.checkpoint.pretrained import WeightsSource
from vistrain.checkpoint.safetensors_file import is_safetensors, save_safetensors_streamed
from vistrain.checkpoint.tensor_file import save_streamed
from vistrain.config import ConfigError
from vistrain.methods import load_config
from vistrain.models.trunks import TRUNKS, TrunkFamily

logger = logging.getLogger("vistrain")

TRUNK = "trunk."  # the trunk's keys in a vistrain checkpoint
TEACHER = "teacher."  # the momentum teacher's keys (benchmarks' WEIGHTS_FROM: teacher)
LIBRARIES = ("torchvision", "timm")


@dataclass
class Export:
    """What an export wrote and what the model card says about it."""

    out: str
    library: str  # whose keys: "torchvision" or "timm"
    specs: "OrderedDict" = field(repr=False)  # library key -> (shape, dtype), as written
    source: str = ""  # the checkpoint folder or file read
    network: str = "student"  # or "teacher"
    family: str = ""  # MODEL.TRUNK.NAME
    run_dir: Optional[str] = None  # the run folder, when the source is a checkpoint folder
    cfg: object = None  # its config.yaml (a CfgNode), when there is one
    meta: dict = field(default_factory=dict, repr=False)  # the checkpoint's metadata.json


def to_torchvision(path: str, out: str, teacher: bool = False) -> Export:
    """Write the trunk of ``path`` as its torchvision model's state dict (no classifier). Load:
    ``model.fc = nn.Identity()`` (a ViT: ``model.heads``), ``load_state_dict(sd, strict=True)``;
    ``model(x)`` is then the trunk's pooled feature (the model card has the exact lines)."""
    return export_trunk(path, out, "torchvision", teacher)


def to_timm(path: str, out: str, teacher: bool = False) -> Export:
    """Write the trunk of ``path`` as the state dict of its timm model (families with ``to_timm``)."""
    return export_trunk(path, out, "timm", teacher)


def to_safetensors(path: str, out: str, teacher: bool = False) -> Export:
    """Write the trunk of ``path`` in its family's library's keys as a ``.safetensors`` file."""
    if not is_safetensors(out):
        raise CheckpointError(f"{out}: a safetensors export's name ends in .safetensors")
    return export_trunk(path, out, None, teacher)


def export_trunk(path: str, out: str, library: Optional[str], teacher: bool = False) -> Export:
    """Write the trunk (the teacher's with ``teacher``) of checkpoint ``path`` to ``out`` in
    ``library``'s keys (None: timm's for a family with ``to_timm``, else torchvision's), one tensor
    in memory at a time. CheckpointError (one line) for a checkpoint without that network or
    trunk, or a family without that export."""
    source = WeightsSource(path)
    ours = source.specs()
    network = "teacher" if teacher else "student"
    prefix = (TEACHER if teacher else "") + TRUNK
    run_dir, cfg = run_of(source.path)
    if teacher and not any(k.startswith(TEACHER) for k in ours):
        method = f" (LOSS.NAME {cfg.LOSS.NAME} trains none)" if cfg is not None else ""
        raise CheckpointError(f"{source.path}: holds no momentum teacher{method}: export without --teacher")
    name, fam = _family(source.path, cfg, ours, prefix)
    library = library or ("timm" if fam.to_timm is not None else "torchvision")
    convert = fam.to_timm if library == "timm" else fam.to_torchvision
    if convert is None:
        raise CheckpointError(
            f"a {name} trunk has no {library} export: use --to-torchvision or --to-safetensors"
        )
    try:
        names = convert(OrderedDict((key, key) for key in ours), prefix)  # library key -> our key
    except ValueError as error:
        raise CheckpointError(f"{source.path}: {error}") from None
    specs = OrderedDict((key, ours[ckpt_key]) for key, ckpt_key in names.items())
    if is_safetensors(out):
        save_safetensors_streamed(out, specs, lambda key: source.read(names[key]), {"format": "pt"})
    else:
        save_streamed(out, specs, lambda key: source.read(names[key]))
    meta = source.reader.meta if source.reader is not None else {}
    return Export(out, library, specs, source.path, network, name, run_dir, cfg, meta)


def run_of(source_path: str) -> Tuple[Optional[str], object]:
    """(run folder, its config.yaml as a config or None) of a checkpoint folder (its parent); a
    file has none. A config.yaml this vistrain cannot read is logged and left out."""
    if not os.path.isfile(os.path.join(source_path, METADATA)):
        return None, None
    run_dir = os.path.dirname(os.path.abspath(source_path))
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return run_dir, None
    try:
        return run_dir, load_config([f"config={path}"])
    except ConfigError as error:
        logger.warning(f"{path} not read ({error}); the trunk family is told by the checkpoint's keys")
        return run_dir, None


def _family(path: str, cfg, specs: dict, prefix: str) -> Tuple[str, TrunkFamily]:
    """MODEL.TRUNK.NAME and its family: the config's, else the one whose torchvision prefixes
    the trunk keys start with."""
    if cfg is not None:
        name = cfg.MODEL.TRUNK.NAME
        if name not in TRUNKS:
            raise CheckpointError(f"{path}: MODEL.TRUNK.NAME {name!r} is not a trunk of this vistrain")
        return name, TRUNKS[name]
    firsts = {key[len(prefix) :].split(".")[0] for key in specs if key.startswith(prefix)}
    if not firsts:
        found = ", ".join(list(specs)[:3])
        raise CheckpointError(
            f"{path}: holds no {prefix}* keys (found {found}...): not a vistrain checkpoint"
        )
    for name, fam in TRUNKS.items():
        if firsts & set(fam.torchvision_prefixes):
            return name, fam
    raise CheckpointError(
        f"{path}: trunk keys {prefix}{sorted(firsts)[0]}... are of no known trunk family, and no "
        "config.yaml beside the checkpoint names it"
    )
