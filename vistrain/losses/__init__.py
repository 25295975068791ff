"""Loss math on plain tensors, in one process or under torch.distributed: NT-Xent (``simclr.py``),
SwAV's swapped prediction and Sinkhorn-Knopp (``swav.py``), DINO's centred cross-entropy
(``dino.py``), DINOv2's iBOT masked-patch loss and KoLeo (``ibot.py``, ``koleo.py``), BYOL's normalised regression (``byol.py``), MoCo v3 (``moco.py``), Barlow Twins,
VICReg and LeJEPA (``barlow_twins.py``, ``vicreg.py``, ``lejepa.py``, on ``global_batch.py``), MSN's
prototype cross-entropy with me-max (``msn.py``), and
the momentum teacher with its cosine schedule (``teacher.py``). The methods (``vistrain/methods/``)
call them from their criteria."""

from vistrain.losses.byol import byol_loss, symmetric_byol_loss
from vistrain.losses.dino import DINOLoss, teacher_temperature
from vistrain.losses.simclr import SimCLRLoss, mix_crops
from vistrain.losses.swav import SwAVLoss, sinkhorn_knopp
from vistrain.losses.teacher import MomentumTeacher, cosine_momentum

__all__ = [
    "DINOLoss",
    "MomentumTeacher",
    "SimCLRLoss",
    "SwAVLoss",
    "byol_loss",
    "cosine_momentum",
    "mix_crops",
    "sinkhorn_knopp",
    "symmetric_byol_loss",
    "teacher_temperature",
]
