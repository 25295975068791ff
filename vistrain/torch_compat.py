"""The only place vistrain touches private names of torch and torchvision.

Each use is here because no public API gives the same thing; ``tests/test_torch_compat.py`` pins
what we rely on, so an upgrade that changes it fails loudly there instead of silently elsewhere.

* ``BatchNormBase`` (``torch.nn.modules.batchnorm._BatchNorm``): the common base of BatchNorm1d/2d/3d
  and SyncBatchNorm. Sync-BN conversion, fp32 BatchNorm units and our CPU sync BN need "any batch
  norm"; torch itself converts by this class (``SyncBatchNorm.convert_sync_batchnorm``).
* ``NormBase`` (``_NormBase``): also covers InstanceNorm; weight decay exclusions need it.
* ``regnet_stage_settings``: torchvision's ``BlockParams`` computes the per-stage widths, strides,
  depths, group widths and bottleneck ratios of a RegNet only through ``_get_expanded_params``.
* ``queue_autograd_callback`` (``Variable._execution_engine.queue_callback``): run a function when
  the current backward pass ends; the sharded engine finishes its gradient reductions there, as
  torch's own FSDP does.
* ``backward_running`` (``torch._C._current_graph_task_id``): whether this thread is inside a
  backward pass (the engine tells a backward an exception interrupted from one still running).
* ``own_parameters`` / ``own_buffers`` / ``child_modules`` (``nn.Module._parameters`` ...) and
  ``view_base`` (``Tensor._base``): the engine swaps parameters for views of gathered weights and
  children for units in place, and finds the gathered tensor a saved view belongs to.
* ``default_store`` (``torch.distributed.distributed_c10d._get_default_store``): the rendezvous
  store of the default process group; the ranks of a joined job use it to agree who prints an error.
* ``version_counter`` (``Tensor._version``): bumped by every in-place change; the engine tells a
  ``shard.grad`` that ``zero_grad(set_to_none=False)`` zeroed from one left alone.
* ``current_saved_tensors_hooks`` / ``saved_tensors_hooks_enabled``
  (``torch._C._autograd._top_saved_tensors_default_hooks`` / ``_saved_tensors_hooks_is_enabled``):
  the engine's saved-tensor hooks wrap those already active (activation checkpointing's).
* ``meta_trunc_normal_refused`` (``torch.nn.init._no_grad_trunc_normal_``): torch's truncated
  normal returns a meta tensor untouched and rejection-samples (data-dependent draws), so a
  meta-device build that uses it cannot be replayed unit by unit; the per-unit build refuses it.
* ``fused_attention`` (``aten._scaled_dot_product_flash_attention_for_cpu``) and
  ``redispatch_torch_function`` (``torch._C._skip_one_hop_torch_function``): the planner's meta
  trace computes attention as a run does, fused, where the meta device has only the math path.
"""

import contextlib
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.autograd import Variable
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401  (re-exported)
from torchvision.models.regnet import BlockParams

BatchNormBase = _BatchNorm
NormBase = _NormBase


class StageSettings(NamedTuple):
    """One RegNet stage as torchvision builds it (``AnyStage`` arguments)."""

    width: int
    stride: int
    depth: int
    group_width: int
    bottleneck_multiplier: float


def regnet_stage_settings(block_params: BlockParams) -> List[StageSettings]:
    """Per-stage settings of the RegNet design space point ``block_params``, first stage first."""
    return [StageSettings(*settings) for settings in block_params._get_expanded_params()]


def queue_autograd_callback(fn: Callable[[], None]) -> None:
    """Call ``fn`` once the backward pass that is running now has finished (call from a hook)."""
    Variable._execution_engine.queue_callback(fn)


def backward_running() -> bool:
    """True inside a backward pass of this thread (hooks, checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


# -- a module's own registries (``nn.Module._parameters`` / ``_buffers`` / ``_modules``) ---------
# The sharded engine replaces parameters by views and wrapped children by units in place; the
# public ``named_*`` iterators give copies, ``register_*`` refuse names already in ``__dict__``.


def own_parameters(module: nn.Module) -> Dict[str, Optional[nn.Parameter]]:
    """The live dict of parameters registered on ``module`` itself (not its children)."""
    return module._parameters


def own_buffers(module: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """The live dict of buffers registered on ``module`` itself."""
    return module._buffers


def child_modules(module: nn.Module) -> Dict[str, Optional[nn.Module]]:
    """The live dict of ``module``'s direct children."""
    return module._modules


def persistent_buffer_names(module: nn.Module) -> List[str]:
    """Names of the buffers of ``module`` itself that go into its state dict."""
    return [
        n for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set
    ]


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``t`` is a view of (``t._base``: public in use, private by name), or None."""
    return t._base


def version_counter(t: torch.Tensor) -> int:
    """How many in-place changes ``t``'s data has seen (``t._version``)."""
    return t._version


def current_saved_tensors_hooks() -> Optional[Tuple[Callable, Callable]]:
    """The innermost active (pack, unpack) saved-tensor hooks, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def saved_tensors_hooks_enabled() -> bool:
    """False inside ``torch.autograd.graph.disable_saved_tensors_hooks`` (pushing hooks raises)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


# -- recording a model's initialisation on the meta device (vistrain.fsdp.deferred_init) ------
# ``TorchDispatchMode`` sees every ATen call with its arguments (public in spirit, private by
# module name); pytree maps nested arguments; a storage's ``_cdata`` identifies it also on the
# meta device, where ``data_ptr()`` is 0 for every tensor.


@contextlib.contextmanager
def meta_trunc_normal_refused(refuse: Callable[[torch.Tensor], None]):
    """Within the block, ``torch.nn.init.trunc_normal_`` on a meta tensor calls ``refuse(t)``
    (which raises); on other tensors it runs as usual."""
    original = torch.nn.init._no_grad_trunc_normal_

    def checked(tensor, *args, **kwargs):
        if tensor.is_meta:
            refuse(tensor)
        return original(tensor, *args, **kwargs)

    torch.nn.init._no_grad_trunc_normal_ = checked
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = original


def op_is_mutable(func) -> bool:
    """Whether the ATen operator ``func`` (an ``OpOverload``) writes into one of its inputs."""
    return func._schema.is_mutable


def storage_id(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (shared by its views), valid on every device including meta."""
    return t.untyped_storage()._cdata


# -- reading one tensor of a torch.save file (vistrain.checkpoint.tensor_file) -----------------
# ``torch.load(f, map_location="meta")`` records on each storage where its bytes start inside the
# zip (``_checkpoint_offset``, set for torch's own lazy loading); legacy files have none.


def storage_file_offset(storage: torch.UntypedStorage) -> Optional[int]:
    """Byte offset in the file of the data of ``storage``, a storage ``torch.load(f,
    map_location="meta")`` gave (zip format); None when torch recorded none."""
    return getattr(storage, "_checkpoint_offset", None)


def default_store():
    """The key-value store the default process group met through (a TCPStore, FileStore or their
    prefixed view); initialised process group required."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# -- attention as a run computes it, on the meta device (vistrain.planner.shape) -------------
# ``F.scaled_dot_product_attention`` picks a fused kernel on CPU and CUDA but the math path on
# the meta device; the flash kernel's meta function gives the fused kernel's outputs, and a torch
# function mode calls the functions it lets through with itself still active only by skipping its
# own hop (``torch.overrides.redispatch_function`` in torch >= 2.10).


def fused_attention(q, k, v, is_causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v for (N, h, L, E) tensors by the flash kernel (saving q, k, v, the
    output and the (N, h, L) log-sum-exp), without dropout nor mask."""
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return out


def redispatch_torch_function(func, types, args, kwargs):
    """Call ``func`` from a ``TorchFunctionMode`` handler skipping that mode's own hop, so that
    under ``with mode:`` the calls inside ``func`` reach the mode; None where torch cannot (the
    caller then calls ``func`` with the mode off)."""
    skip = getattr(torch._C, "_skip_one_hop_torch_function", None)
    return None if skip is None else skip(func, types, args, kwargs)


# -- ending a DataLoader pass's workers (vistrain.data.workers) --------------------------------
# The iterator's ``_shutdown_workers`` is what its ``__del__``, an exhausted pass and torch's own
# exit handler (persistent workers with pinned memory only) call; there is no public name for it.


def end_loader_workers(iterator) -> None:
    """End the workers of a DataLoader iterator (each finishes the item in hand first); a no-op for
    an iterator without workers or already ended."""
    shut_down = getattr(iterator, "_shutdown_workers", None)
    if shut_down is not None:
        shut_down()
