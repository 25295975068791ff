"""Trunk + head, with multi-crop batching. A plain nn.Module: it knows nothing about sharding."""

from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from vistrain.config.errors import ConfigError

Crops = Union[torch.Tensor, Sequence[torch.Tensor]]


class SSLModel(nn.Module):
    """``forward(crops)`` with crops a Tensor (N, 3, H, W) or a list of C such tensors (views).
    The head reads the trunk feature ``in_feature`` (default: the one the head declares).

    Consecutive crops of the same resolution are concatenated and go through the trunk together
    (as in SwAV's multi-crop), so the trunk runs once per run of equal resolutions; the head then
    runs once on all crops' features, concatenated in crop order (rows c*N .. (c+1)*N-1 belong to
    crop c). Output, by head:

    * MLP ("simclr"): embeddings (C*N, D);
    * SwAVHead ("swav"): (embeddings (C*N, D) L2-normalised, [scores (C*N, K_j) per layer]);
    * IdentityHead ("identity"): the trunk's feature dict of a single tensor input.

    ``forward(crops, **masking)``: masked-image modelling. The method's masks (``keep=`` or
    ``mask=``, ``vistrain.models.masking``) go to the trunk and to a head on the token "sequence"
    (MAE's decoder puts the kept tokens back in place), for crops of one resolution;
    ``head(trunk(x, keep=, mask=)[in_feature], **masking)``: other keys (I-JEPA's ``targets=``) go
    to the head alone. A head on one vector per image ("avgpool", "cls") gets no mask: the mask
    covers the images of the first run of equal resolutions, the later runs go whole (MSN's masked
    anchors and its focal crops).

    A head that declares ``by_resolution`` (DINO's on the token sequence: sequences of two
    resolutions do not concatenate) gets a list instead, one feature per run of equal
    resolutions, and ``mask=`` a list aligned with it: ``head([f_1, ...], mask=None)`` without
    masking, else ``mask=[m_1 or None, ...]`` with ``forward(crops, mask=[(N, L) or None, ...])``
    masking the first crops (a list aligned with them: the global crops; the others unmasked).
    ``forward(crops, head_mask=[...])`` hands the head the same masks but leaves the trunk's
    input whole: a teacher that sees every patch and scores the ones the student's masks hide
    (DINOv2's iBOT).
    """

    def __init__(self, trunk: nn.Module, head: nn.Module, in_feature: Optional[str] = None):
        super().__init__()
        self.trunk = trunk
        self.head = head
        self.in_feature = in_feature if in_feature is not None else getattr(head, "in_feature", None)
        in_feature = self.in_feature
        if in_feature is not None and in_feature not in trunk.out_features:
            raise ConfigError(
                f"the head reads trunk feature {in_feature!r}: add it to MODEL.TRUNK.OUT_FEATURES "
                f"(now {trunk.out_features})"
            )

    def forward(self, crops: Crops, **masking):
        crops = _as_crop_list(crops)
        in_feature = self.in_feature
        if getattr(self.head, "by_resolution", False):
            return self._by_resolution(crops, in_feature, **masking)
        if masking and in_feature != "sequence" and in_feature is not None:
            return self._first_run_masked(crops, in_feature, **masking)
        if masking:
            if in_feature is None or len(_same_resolution_runs(crops)) != 1:
                raise ValueError(
                    "masked crops go through a head that reads one trunk feature, one resolution"
                )
            trunk_masking = {k: v for k, v in masking.items() if k in ("keep", "mask")}
            return self.head(self.trunk(torch.cat(crops), **trunk_masking)[in_feature], **masking)
        if in_feature is None:
            if len(crops) != 1:
                raise ValueError(f"a feature-dict head takes one tensor, got {len(crops)} crops")
            return self.head(self.trunk(crops[0]))
        features = [self.trunk(torch.cat(group))[in_feature] for group in _same_resolution_runs(crops)]
        return self.head(torch.cat(features))

    def _first_run_masked(self, crops: List[torch.Tensor], in_feature: str, **masking):
        """A head on one vector per image (MSN's): ``keep=`` or ``mask=`` for the crops of the
        first run of equal resolutions, the other runs whole; the head reads every crop's
        pooled feature, in crop order, and no mask."""
        if len(masking) != 1 or not masking.keys() <= {"keep", "mask"}:
            raise ValueError(
                f"a head on the {in_feature!r} feature takes keep= or mask= only, got {sorted(masking)}"
            )
        runs = _same_resolution_runs(crops)
        features = [self.trunk(torch.cat(runs[0]), **masking)[in_feature]]
        features += [self.trunk(torch.cat(run))[in_feature] for run in runs[1:]]
        return self.head(torch.cat(features))

    def _by_resolution(self, crops: List[torch.Tensor], in_feature: str, mask=None, head_mask=None, **others):
        """``head(features per run, mask=masks per run)``; ``mask`` (trunk and head) or
        ``head_mask`` (the head only) a list of per-crop (N, L) masks (or None) for the first
        crops, None for no masking at all."""
        trunk_masked, both = head_mask is None, mask is not None and head_mask is not None
        mask = mask if trunk_masked else head_mask
        wrong = mask is not None and (isinstance(mask, torch.Tensor) or len(mask) > len(crops))
        if others or wrong or both:
            raise ValueError(
                "this head takes mask= or head_mask=[a mask (N, L) or None for each of the first crops] only"
            )
        features, run_masks, start = [], [], 0
        for run in _same_resolution_runs(crops):
            masks = [
                mask[i] if mask is not None and i < len(mask) else None
                for i in range(start, start + len(run))
            ]
            start += len(run)
            run_mask = _run_mask(run, masks)
            kwargs = {} if run_mask is None or not trunk_masked else {"mask": run_mask}
            features.append(self.trunk(torch.cat(run), **kwargs)[in_feature])
            run_masks.append(run_mask)
        return self.head(features, mask=None if mask is None else run_masks)


def _run_mask(run: List[torch.Tensor], masks: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The masks of a run's crops concatenated (an unmasked crop: all False), None if none is masked."""
    given = [m for m in masks if m is not None]
    if not given:
        return None
    blank = torch.zeros_like(given[0])
    return torch.cat([blank if m is None else m for m in masks])


def _as_crop_list(crops: Crops) -> List[torch.Tensor]:
    crops = [crops] if isinstance(crops, torch.Tensor) else list(crops)
    if not crops or any(c.dim() != 4 for c in crops):
        raise ValueError("SSLModel expects a (N, 3, H, W) tensor or a non-empty list of them")
    sizes = {c.shape[0] for c in crops}
    if len(sizes) != 1:
        raise ValueError(f"all crops must hold the same number of images, got {[c.shape[0] for c in crops]}")
    return crops


def _same_resolution_runs(crops: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Split the crop list into maximal runs of consecutive crops with equal (H, W)."""
    runs = [[crops[0]]]
    for crop in crops[1:]:
        if crop.shape[-2:] == runs[-1][-1].shape[-2:]:
            runs[-1].append(crop)
        else:
            runs.append([crop])
    return runs
