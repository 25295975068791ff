"""The flat registries of the method layer, filled by plain imports: ``METHODS`` (LOSS.NAME ->
:class:`Method`) and ``HEADS`` (MODEL.HEAD.NAME -> :class:`Head`: "identity", the benchmarks' frozen
trunk, and every method's head)."""

from typing import Dict

from vistrain.methods import (
    barlow_twins,
    byol,
    dino,
    ijepa,
    lejepa,
    mae,
    moco_v3,
    msn,
    nnclr,
    simclr,
    simmim,
    simsiam,
    supervised,
    swav,
    vicreg,
)
from vistrain.methods.base import Head, Method
from vistrain.models.heads import build_identity_head

METHODS: Dict[str, Method] = {
    "simclr_loss": simclr.METHOD,
    "swav_loss": swav.METHOD,
    "dino_loss": dino.METHOD,
    "byol_loss": byol.METHOD,
    "mae_loss": mae.METHOD,
    "moco_v3_loss": moco_v3.METHOD,
    "barlow_twins_loss": barlow_twins.METHOD,
    "vicreg_loss": vicreg.METHOD,
    "lejepa_loss": lejepa.METHOD,
    "simsiam_loss": simsiam.METHOD,
    "nnclr_loss": nnclr.METHOD,
    "supervised_loss": supervised.METHOD,
    "simmim_loss": simmim.METHOD,
    "ijepa_loss": ijepa.METHOD,
    "msn_loss": msn.METHOD,
}
DEFAULT_METHOD = "simclr_loss"  # LOSS.NAME's default; its head is MODEL.HEAD.NAME's

# methods that read the same head share its Head record (imported from the method file defining it)
HEADS: Dict[str, Head] = {
    "identity": Head("identity", build_identity_head),
    **{method.head.name: method.head for method in METHODS.values()},
}


def method_of(loss_cfg) -> Method:
    """The method of ``LOSS`` (its NAME); ValueError listing the valid names otherwise."""
    if loss_cfg.NAME not in METHODS:
        raise ValueError(f"unknown LOSS.NAME {loss_cfg.NAME!r}; valid names: {sorted(METHODS)}")
    return METHODS[loss_cfg.NAME]


def head_of(head_cfg) -> Head:
    """The head of ``MODEL.HEAD``; ValueError listing the valid names otherwise."""
    if head_cfg.NAME not in HEADS:
        raise ValueError(f"unknown MODEL.HEAD.NAME {head_cfg.NAME!r}; valid names: {sorted(HEADS)}")
    return HEADS[head_cfg.NAME]
