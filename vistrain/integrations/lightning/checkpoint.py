"""Lightning checkpoints in vistrain's world-size independent sharded format.

``trainer.save_checkpoint(path)`` and ``ModelCheckpoint`` write the folder ``path`` as
``vistrain.checkpoint`` does (format in its ``__init__``): every rank writes the slices of the
original parameters and of their optimizer state that it owns, in parallel, and nothing is
gathered through rank 0. What Lightning keeps besides (epoch, global step, loops, callbacks,
LR schedulers, the precision plugin's scaler, hyperparameters) travels in rank 0's ``extra``
under ``"lightning"``, every value one ``torch.load(weights_only=True)`` reads back.
``tools/convert_checkpoint.py`` converts the folder like any other; ``Trainer.fit(ckpt_path=path)``
resumes from it on any number of devices.

Several optimizers (manual optimization) are saved as one: their param groups in order, their
states side by side (a parameter belongs to one optimizer).
"""

import logging
import os
from collections.abc import Mapping
from typing import Dict, List, Optional, Sequence

import pytorch_lightning as pl
import torch

from vistrain.checkpoint import load_sharded_checkpoint, write_sharded_checkpoint
from vistrain.checkpoint.files import METADATA, CheckpointError
from vistrain.checkpoint.layout import model_layout
from vistrain.checkpoint.load import SliceReader, load_optimizer_state
from vistrain.distributed import comm
from vistrain.integrations.lightning.errors import StrategyError

logger = logging.getLogger("vistrain")

LIGHTNING = "lightning"  # rank 0's extra: {"checkpoint": Lightning's dict, "optimizers": class names}
PATH_KEY = "vistrain_checkpoint"  # in the dict handed to Lightning: the folder to load from
HYPER_PARAMETERS = "hyper_parameters"
_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.Tensor,
    torch.dtype,
    torch.device,
    torch.Size,
)


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def save(path: str, model, optimizers: Sequence, checkpoint: dict, progress: Optional[dict] = None) -> None:
    """Write Lightning's ``checkpoint`` dict, ``model`` and (unless the dict is weights-only,
    without ``"optimizer_states"``) ``optimizers`` to the folder ``path``. Collective.
    ``progress`` (``iteration_in_epoch``, ``iters_per_epoch``) goes to metadata.json, for
    ``tools/convert_checkpoint.py --inspect``."""
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    with_optimizers = "optimizer_states" in checkpoint and len(optimizers) > 0
    state = {
        "checkpoint": weights_only_safe(rest, "checkpoint"),
        "optimizers": [_optimizer_info(o) for o in optimizers] if with_optimizers else None,
    }
    meta = {
        "epoch": checkpoint.get("epoch"),
        "lightning_version": checkpoint.get("pytorch-lightning_version"),
        **(progress or {}),
    }
    write_sharded_checkpoint(
        path,
        int(checkpoint.get("global_step", 0)),
        model,
        as_one_optimizer(optimizers) if with_optimizers else None,
        {LIGHTNING: state} if comm.get_rank() == 0 else {},
        meta,
    )


def read(path: str) -> dict:
    """Lightning's dict as saved (its epoch, loops, callbacks...), for ``Strategy.load_checkpoint``:
    ``"state_dict"`` is empty and ``PATH_KEY`` names the folder the weights and optimizer state
    are loaded from (:func:`load_model`, :func:`load_optimizers`)."""
    reader = SliceReader(path)
    extra = reader.values(0, reader.file(0)["extra"])
    state = extra.get(LIGHTNING) if isinstance(extra, dict) else None
    if state is None:  # a checkpoint of vistrain's own trainer: weights only
        checkpoint = {"epoch": reader.meta.get("epoch", 0), "global_step": reader.meta["iteration"]}
    else:
        checkpoint = dict(state["checkpoint"])
        if state["optimizers"] is not None:
            checkpoint["optimizer_states"] = state["optimizers"]
    checkpoint.setdefault("pytorch-lightning_version", reader.meta.get("lightning_version") or pl.__version__)
    checkpoint["state_dict"] = {}
    checkpoint[PATH_KEY] = path
    return checkpoint


def load_model(checkpoint: dict, model) -> None:
    """Weights and buffers of the folder :func:`read` found, into this rank's part of ``model``."""
    load_sharded_checkpoint(_path(checkpoint), model)


def load_optimizers(checkpoint: dict, model, optimizers: Sequence) -> None:
    """This rank's optimizer state (its shards' slices), from a run on any number of devices, and
    the param groups' hyperparameters as saved (as ``Optimizer.load_state_dict`` restores them:
    an LR scheduler sets ``lr`` only at its next step)."""
    saved = checkpoint.get("optimizer_states", [])
    if [s["class"] for s in saved] != [type(o).__name__ for o in optimizers] or any(
        len(s["param_groups"]) != len(o.param_groups) for s, o in zip(saved, optimizers)
    ):
        raise CheckpointError(
            f"{_path(checkpoint)}: holds the state of optimizers {[s['class'] for s in saved]} with "
            f"{[len(s['param_groups']) for s in saved]} param groups, this run configures "
            f"{[type(o).__name__ for o in optimizers]} with {[len(o.param_groups) for o in optimizers]}; "
            "resume with the same configure_optimizers"
        )
    if optimizers:
        path = _path(checkpoint)
        load_optimizer_state(as_one_optimizer(optimizers), model_layout(model), SliceReader(path))
    for info, optimizer in zip(saved, optimizers):
        for group, hyper in zip(optimizer.param_groups, info["param_groups"]):
            group.update(hyper)


def _optimizer_info(optimizer) -> dict:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"class": type(optimizer).__name__, "param_groups": weights_only_safe(groups, "param_groups")}


def _path(checkpoint: dict) -> str:
    if PATH_KEY not in checkpoint:
        raise StrategyError("this checkpoint was not read by vistrain_fsdp; pass its folder as ckpt_path")
    return checkpoint[PATH_KEY]


def as_one_optimizer(optimizers: Sequence):
    """What ``vistrain.checkpoint`` saves and loads: the optimizer itself, or all as one."""
    return optimizers[0] if len(optimizers) == 1 else OptimizerSet(optimizers)


class OptimizerSet:
    """Several optimizers seen as one: param groups in order, states side by side, and
    ``state_dict()`` / ``load_state_dict()`` numbering parameters across them."""

    def __init__(self, optimizers: Sequence):
        self.optimizers = list(optimizers)
        owners: Dict[int, int] = {}
        for i, optimizer in enumerate(self.optimizers):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if owners.setdefault(id(param), i) != i:
                        raise StrategyError(
                            "a parameter is held by two optimizers; its state could not be saved once"
                        )

    @property
    def param_groups(self) -> List[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        merged = {}
        for optimizer in self.optimizers:
            merged.update(optimizer.state)
        return merged

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for optimizer in self.optimizers:
            own = optimizer.state_dict()
            state.update({offset + i: s for i, s in own["state"].items()})
            groups += [dict(g, params=[offset + i for i in g["params"]]) for g in own["param_groups"]]
            offset += sum(len(g["params"]) for g in optimizer.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups, offset = list(state_dict["param_groups"]), 0
        for optimizer in self.optimizers:
            mine, groups = groups[: len(optimizer.param_groups)], groups[len(optimizer.param_groups) :]
            count = sum(len(g["params"]) for g in optimizer.param_groups)
            optimizer.load_state_dict(
                {
                    "state": {
                        i - offset: s for i, s in state_dict["state"].items() if offset <= i < offset + count
                    },
                    "param_groups": [dict(g, params=[i - offset for i in g["params"]]) for g in mine],
                }
            )
            offset += count


def weights_only_safe(obj, where: str, in_hparams: bool = False):
    """``obj`` with containers made plain (mappings -> dict, tuples -> tuple) so that
    ``torch.load(weights_only=True)`` reads it back. Any other object is refused with a line
    naming its key, except inside the hyperparameters, which a resume does not read: their
    ``repr`` is kept (a warning says so)."""
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, Mapping):
        return {
            k: weights_only_safe(v, f"{where}[{k!r}]", in_hparams or k == HYPER_PARAMETERS)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [weights_only_safe(v, f"{where}[{i}]", in_hparams) for i, v in enumerate(obj)]
        return type(obj)(items) if type(obj) in (list, tuple, set, frozenset) else tuple(items)
    if in_hparams:
        logger.warning(
            f"{where}: a {type(obj).__name__} is saved as its repr (checkpoints hold plain values)"
        )
        return repr(obj)
    raise StrategyError(
        f"{where} holds a {type(obj).__name__}, which a weights_only checkpoint cannot store; "
        "save plain values (numbers, strings, tensors, lists, dicts) in on_save_checkpoint / state_dict"
    )
