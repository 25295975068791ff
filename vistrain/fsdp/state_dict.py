"""Full (consolidated) state dicts of a sharded model, and the full parameters on demand.

The full state dict has exactly the keys and shapes of the unwrapped module, so it loads into
the plain model (and back). Building it is collective: every rank gathers every unit.
"""

import contextlib
from collections import OrderedDict
from typing import List, NamedTuple

import torch

from vistrain.fsdp.ownership import clean_name, is_shard_key
from vistrain.fsdp.unit import Phase


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns (the fields of torch's own result)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


@contextlib.contextmanager
def summon(fsdp, recurse: bool, writeback: bool):
    """Body of ``summon_full_params``: expose full fp32 copies as parameters, write back on exit.

    Units already summoned by an enclosing block are left to it.
    """
    units = [u.unit_state for u in (fsdp.units() if recurse else [fsdp])]
    with contextlib.ExitStack() as stack:
        for unit in units:
            if unit.phase is not Phase.SUMMONED:
                stack.enter_context(unit.summoned(writeback))
        yield


def full_state_dict(fsdp, module_state_dict) -> "OrderedDict[str, torch.Tensor]":
    """Gather the full parameters of every unit and return clean-keyed detached copies."""
    with fsdp.summon_full_params(writeback=False):
        raw = module_state_dict()
        return OrderedDict((clean_name(k), v.detach().clone()) for k, v in raw.items() if not is_shard_key(k))


def load_full_state_dict(fsdp, state_dict, strict: bool, module_state_dict):
    """Copy ``state_dict`` (clean keys) into the full parameters and write the shards back."""
    with fsdp.summon_full_params(writeback=True):
        internal = module_state_dict(keep_vars=True)
        targets = {clean_name(k): v for k, v in internal.items() if not is_shard_key(k)}
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"state dict does not match the model: missing keys {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                f"{'...' if len(unexpected) > 5 else ''}"
            )
        with torch.no_grad():
            for key, target in targets.items():
                if key not in state_dict:
                    continue
                value = state_dict[key]
                if tuple(value.shape) != tuple(target.shape):
                    raise RuntimeError(
                        f"state dict key {key}: shape {tuple(value.shape)} does not match the "
                        f"model's {tuple(target.shape)}"
                    )
                target.copy_(value)
    return IncompatibleKeys(missing, unexpected)
