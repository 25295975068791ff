"""The optimizer step inside backward: each flat shard is updated as soon as its gradient is final.

``optimizer.step()`` after backward needs every shard's gradient at once: a rank holds its whole
gradient shard (as many bytes as its parameter shards) at the end of every backward. Here the
model's reductions call :meth:`OptimizerInBackward.step_shard` for each flat parameter once its
reduce-scatter has finished and been added to ``shard.grad``; the bound optimizer updates that
shard alone and the gradient is freed. A rank then holds the shard gradients of at most the unit
whose reduction just finished and the one in flight, and never the rest.

The update is the ordinary one: ``optimizer.step()`` runs with its parameter groups restricted to
the one shard (same hyperparameters, same ``optimizer.state`` entries, so checkpoints look alike
and a run may resume with the step in backward switched on or off). Element-wise optimizers
(SGD, AdamW) therefore give the same numbers; LARS computes each shard's per-original-parameter
norms with one all-reduce per shard instead of one per step, which sums in another order (a
rounding difference, not another formula).

What needs every gradient before any step cannot run inside backward: the global gradient norm
(``clip_grad_norm_``) and fp16 loss scaling (a step skipped on overflow). Gradient accumulation
works: under ``no_sync()`` nothing is reduced and nothing steps; the synced backward steps.
"""

from typing import Iterable

from torch import nn
from torch.optim import Optimizer

from vistrain.fsdp.flat_param import FlatParamHandle


class OptimizerInBackward:
    """Runs ``optimizer`` on each flat shard of a wrapped model when its gradient is final.

    Shards the optimizer does not hold keep their gradient (nothing is dropped silently);
    shards passed to :meth:`freeze` have their gradient dropped and are not updated (SwAV's
    frozen prototypes: as when the ordinary loop sets their ``.grad`` to None before the step).
    """

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self._frozen = set()
        self._group_index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}

    def freeze(self, params: Iterable[nn.Parameter]) -> None:
        """Skip these shards in the following backward passes (until the next call)."""
        self._frozen = {id(p) for p in params}

    def step_shard(self, handle: FlatParamHandle) -> None:
        shard = handle.shard
        index = self._group_index.get(id(shard))
        if index is None or shard.grad is None:
            return
        if id(shard) not in self._frozen:
            groups = self.optimizer.param_groups
            self.optimizer.param_groups = [{**groups[index], "params": [shard]}]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = groups
        shard.grad = None


def apply_optimizer_in_backward(model: nn.Module, optimizer: Optimizer) -> OptimizerInBackward:
    """``model.apply_optimizer_in_backward(optimizer)`` for the root unit ``model`` (see there)."""
    apply = getattr(type(model), "apply_optimizer_in_backward", None)
    if apply is None:
        raise TypeError(
            "apply_optimizer_in_backward needs the root FullyShardedDataParallel of the model "
            f"(got {type(model).__name__}): the step in backward follows the engine's reductions"
        )
    return apply(model, optimizer)
