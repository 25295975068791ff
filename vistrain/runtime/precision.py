"""The config's dtype names and the torch dtypes they mean: the one map.

``MODEL.FSDP_CONFIG.compute_dtype`` takes any name of :data:`DTYPES`; ``MODEL.AMP_PARAMS.AMP_DTYPE``
one of :data:`AMP_DTYPES` (autocast to float32 would be no autocast). Both lists reach the config
check through ``vistrain.jobs.catalog()``, so the names are written here only.
"""

from typing import Optional

import torch

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
