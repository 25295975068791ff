"""The only place vistrain touches private names of torch and torchvision.

Each use is here because no public API gives the same thing; ``tests/test_torch_compat.py`` pins
what we rely on, so an upgrade that changes it fails loudly there instead of silently elsewhere.

* ``BatchNormBase`` (``torch.nn.modules.batchnorm._BatchNorm``): the common base of BatchNorm1d/2d/3d
  and SyncBatchNorm. Sync-BN conversion, fp32 BatchNorm units and our CPU sync BN need "any batch
  norm"; torch itself converts by this class (``SyncBatchNorm.convert_sync_batchnorm``).
* ``NormBase`` (``_NormBase``): also covers InstanceNorm; weight decay exclusions need it.
* ``regnet_stage_settings``: torchvision's ``BlockParams`` computes the per-stage widths, strides,
  depths, group widths and bottleneck ratios of a RegNet only through ``_get_expanded_params``.
"""

from typing import List, NamedTuple

from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
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
