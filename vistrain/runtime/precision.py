"""The config's dtype names and the torch dtypes they mean (the one map), and fp16 loss scaling.

``MODEL.FSDP_CONFIG.compute_dtype`` takes any name of :data:`DTYPES`; ``MODEL.AMP_PARAMS.AMP_DTYPE``
one of :data:`AMP_DTYPES` (autocast to float32 would be no autocast). Both lists reach the config
check through ``vistrain.jobs.catalog()``, so the names are written here only.
"""

from typing import Optional

import torch
from torch import nn

from vistrain.fsdp import Backend, backend_of

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
AMP_DTYPES = ("bfloat16", "float16")


def amp_dtype(model_cfg) -> Optional[torch.dtype]:
    """Autocast dtype of ``MODEL.AMP_PARAMS`` (``model_cfg`` is the MODEL section); None without AMP."""
    amp_cfg = model_cfg.AMP_PARAMS
    return DTYPES[amp_cfg.AMP_DTYPE] if amp_cfg.USE_AMP else None


def compute_dtype(fsdp_cfg) -> Optional[torch.dtype]:
    """The sharded engine's compute dtype of ``MODEL.FSDP_CONFIG``; None when it computes in fp32
    (no ``mixed_precision``, or ``compute_dtype`` float32)."""
    dtype = DTYPES[fsdp_cfg.compute_dtype]
    return dtype if fsdp_cfg.mixed_precision and dtype != torch.float32 else None


class LossScaling:
    """fp16 loss scaling of a run: the grad scaler and how many steps it skipped (cumulative
    over the run, resumed with it).

    A step is skipped when some gradient is inf/NaN on any rank; the scale then falls by
    ``BACKOFF_FACTOR`` (< 1), so a skipped step is one after which the scale went down.
    """

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return self.scaler.get_scale()

    def step(self, optimizer) -> None:
        """``scaler.step(optimizer)`` then ``scaler.update()``; counts a skipped step."""
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < before:
            self.skipped_steps += 1

    def state_dict(self) -> dict:
        return {"grad_scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's ``extra`` (older ones hold no ``skipped_steps``)."""
        if "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def loss_scaling(model: nn.Module, model_cfg, device: torch.device) -> Optional[LossScaling]:
    """The run's fp16 loss scaling (None unless ``MODEL.AMP_PARAMS`` autocasts to float16), on
    ``device``: the built-in engine's scaler reduces its found-inf flags over the shard group
    (``model.grad_scaler``); DDP's gradients are already equal on every rank (torch's scaler);
    ``fully_shard``'s gradients are DTensors, whose inf check torch reduces over their mesh."""
    if amp_dtype(model_cfg) != torch.float16:
        return None
    amp_cfg = model_cfg.AMP_PARAMS
    growth = dict(
        init_scale=float(amp_cfg.INIT_SCALE),
        growth_factor=float(amp_cfg.GROWTH_FACTOR),
        backoff_factor=float(amp_cfg.BACKOFF_FACTOR),
        growth_interval=int(amp_cfg.GROWTH_INTERVAL),
    )
    if backend_of(model) is Backend.BUILTIN:
        return LossScaling(model.grad_scaler(**growth))
    return LossScaling(torch.amp.GradScaler(device.type, **growth))
