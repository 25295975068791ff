"""Which parameters and modules a unit owns, where it computes, and checks against misuse."""

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook


def is_unit(module: nn.Module) -> bool:
    """A FullyShardedDataParallel instance (marked by the class, to avoid a circular import)."""
    return getattr(module, "is_sharded_unit", False)


def owned_modules(module: nn.Module):
    """``module`` and its submodules, not descending into nested units."""
    return (sub for sub, _ in _owned_with_prefix(module, ""))


def owned_params(module: nn.Module, prefix: str = ""):
    """(fqn, module, attr, param) of parameters not inside nested units."""
    seen = set()
    for sub, sub_prefix in _owned_with_prefix(module, prefix):
        for attr, param in sub._parameters.items():
            if param is None:
                continue
            if id(param) in seen:
                raise NotImplementedError(
                    f"parameter {sub_prefix}{attr} is shared with another module; tied weights "
                    "are not supported by FullyShardedDataParallel"
                )
            seen.add(id(param))
            yield f"{sub_prefix}{attr}", sub, attr, param


def _owned_with_prefix(module, prefix):
    yield module, prefix
    for name, child in module.named_children():
        if not is_unit(child):
            yield from _owned_with_prefix(child, f"{prefix}{name}.")


def compute_device(module: nn.Module, move_params_to_cpu: bool) -> torch.device:
    if move_params_to_cpu:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_wrappable(module: nn.Module) -> None:
    if is_unit(module):
        raise ValueError("module is already wrapped by FullyShardedDataParallel (wrapping twice)")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "FullyShardedDataParallel needs an initialised process group: call "
            "torch.distributed.init_process_group (or launch with tools/run_distributed.py) first"
        )


_optimizer_check_installed = False


def install_optimizer_check() -> None:
    """Make ``optimizer.step()`` fail when the optimizer was built before wrapping."""
    global _optimizer_check_installed
    if _optimizer_check_installed:
        return
    _optimizer_check_installed = True

    def check(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if getattr(param, "_fsdp_replaced", False):
                    raise RuntimeError(
                        "the optimizer holds parameters that FullyShardedDataParallel replaced by "
                        "shards: build the optimizer on model.parameters() after wrapping"
                    )

    register_optimizer_step_pre_hook(check)
