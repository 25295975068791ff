"""Full (consolidated) state dicts of a sharded model, and the full parameters on demand.

The full state dict has exactly the keys and shapes of the unwrapped module, so it loads into
the plain model (and back). Building it is collective: every rank gathers every unit.
"""

import contextlib
from collections import OrderedDict
from typing import List, NamedTuple

import torch

from vistrain.fsdp.ownership import clean_name
from vistrain.fsdp.unit import Phase
from vistrain.torch_compat import persistent_buffer_names


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


def full_state_dict(fsdp, module_state_dict, destination=None, prefix: str = ""):
    """Gather the full parameters of every unit; put clean-keyed detached copies into
    ``destination`` (a new OrderedDict when None) under ``prefix`` and return it.

    ``destination`` comes from a plain parent's ``state_dict`` when this unit is its child; its
    ``_metadata`` (module versions, read back by ``load_state_dict``) gets clean paths too.
    """
    out = OrderedDict() if destination is None else destination
    with fsdp.summon_full_params(writeback=False):
        raw = module_state_dict()
        for key, value in raw.items():
            out[prefix + clean_name(key)] = value.detach().clone()
    metadata = getattr(out, "_metadata", None)
    if destination is not None and metadata is not None:
        for path, versions in getattr(raw, "_metadata", {}).items():
            clean = clean_name(path)  # the wrapper and its module share a path; the module's wins
            metadata[f"{prefix}{clean}" if clean else prefix[:-1]] = versions
    return out


def positional_state_dict_args(args, destination, prefix: str, keep_vars: bool):
    """``state_dict(destination, prefix, keep_vars)`` given positionally (deprecated in torch,
    still accepted): the three values, keywords filling what ``args`` leaves out."""
    values = list(args) + [destination, prefix, keep_vars][len(args) :]
    return values[0], values[1], values[2]


def load_as_child(fsdp, state_dict: dict, prefix: str, missing: List[str], unexpected: List[str]) -> None:
    """A plain parent's ``load_state_dict`` reached unit ``fsdp`` under ``prefix``.

    Its keys there are the unwrapped module's: they are loaded as ``fsdp.load_state_dict`` does
    (collective) and replaced in ``state_dict`` by what the unit registers (its local parameters
    and persistent buffers, and those of the units below, at their internal names, now holding
    the loaded values), which the parent's recursion then copies onto themselves. Missing and
    unexpected keys join the parent's lists.
    """
    mine = {key[len(prefix) :]: state_dict.pop(key) for key in list(state_dict) if key.startswith(prefix)}
    result = fsdp.load_state_dict(mine, strict=False)
    missing.extend(prefix + key for key in result.missing_keys)
    unexpected.extend(prefix + key for key in result.unexpected_keys)
    for path, sub in fsdp.named_modules(remove_duplicate=False):
        at = f"{prefix}{path}." if path else prefix
        for name, param in sub.named_parameters(recurse=False):
            state_dict[at + name] = param.detach()
        for name in persistent_buffer_names(sub):
            state_dict[at + name] = getattr(sub, name)


def load_full_state_dict(fsdp, state_dict, strict: bool, module_state_dict):
    """Copy ``state_dict`` (clean keys) into the full parameters and write the shards back."""
    with fsdp.summon_full_params(writeback=True):
        internal = module_state_dict(keep_vars=True)
        targets = {clean_name(k): v for k, v in internal.items()}
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
