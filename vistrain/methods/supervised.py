"""Supervised training as a method: cross-entropy of a classifier on the trunk's pooled feature
against the images' labels, through the same trunk, views, recipes and engine as the
self-supervised methods ("the same trunk trained with labels"). Head "supervised": ``DIMS``
[feature width, classes] is a linear classifier (more entries: an MLP). Every crop of an image
carries its label: with multi-crop the loss is the mean over all crops of all images (each crop
weighs alike), a supervised multi-crop baseline. No teacher; 1 or more crops per image."""

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode

from vistrain.config.checks import at_least, below
from vistrain.config.errors import DataError
from vistrain.data.labels import NO_LABEL, crop_labels
from vistrain.methods.base import Criterion, Head, Method
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.supervised_loss."""
    c = CfgNode()
    c.label_smoothing = 0.0  # epsilon of label smoothing (Szegedy et al. 2016); 0: plain cross-entropy
    return c


def build_head(head_cfg) -> MLP:
    return MLP(head_cfg.DIMS, head_cfg.USE_BN)


class SupervisedCriterion(Criterion):
    """``mean over the C*N rows of CE(logits, y)``: ``logits`` (C*N, K) from the supervised head,
    rows [c*N, (c+1)*N) crop c; y the batch's labels (``set_batch``) repeated per crop
    (``vistrain.data.labels.crop_labels``), K = MODEL.HEAD.DIMS[-1] classes. Computed in float32. With equal N per rank the mean of the per-rank losses is the
    single-process loss on the global batch and DDP's average of the gradients its gradient.

    An image without a label (-1) or with a label of K or more is a one-line :class:`DataError`.
    """

    def __init__(self, supervised_cfg, model_cfg=None):
        super().__init__()
        self.label_smoothing = float(supervised_cfg.label_smoothing)
        self._batch = None  # the batch of the next forward (set_batch)

    def set_batch(self, batch: dict) -> None:
        self._batch = batch

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        batch, self._batch = self._batch, None
        if batch is None:
            raise ValueError("supervised_loss reads the labels of the batch set_batch() handed it")
        if not isinstance(model_output, torch.Tensor) or model_output.shape[0] != num_crops * len(
            batch["label"]
        ):
            raise ValueError(
                f"supervised_loss expects ({num_crops} x {len(batch['label'])}, classes) logits from a supervised head"
            )
        labels = check_labels(crop_labels(batch, num_crops, model_output.device), model_output.shape[1])
        with torch.autocast(device_type=model_output.device.type, enabled=False):
            return F.cross_entropy(model_output.float(), labels, label_smoothing=self.label_smoothing)


def check_labels(labels: torch.Tensor, classes: int) -> torch.Tensor:
    """``labels`` when every one is a class of the head's ``classes``; DataError (one line) else."""
    missing = int((labels == NO_LABEL).sum())
    if missing:
        raise DataError(
            f"LOSS.NAME=supervised_loss trains on labels, but {missing} of the batch's {labels.numel()} crops "
            "have none (label -1): give DATA.TRAIN labelled images (class subfolders, or a disk_filelist with "
            "labels) or pick a self-supervised method"
        )
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise DataError(
            f"DATA.TRAIN has label {int(labels.max()) if int(labels.min()) >= 0 else int(labels.min())}, but "
            f"the supervised head has MODEL.HEAD.DIMS[-1]={classes} classes: set it to the number of classes"
        )
    return labels


HEAD = Head("supervised", build_head)

METHOD = Method(
    name="supervised_loss",
    criterion=SupervisedCriterion,
    head=HEAD,
    section=section,
    rules={"label_smoothing": [at_least(0), below(1)]},
    min_crops=1,
)
