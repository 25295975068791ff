"""Watching a run learn: the trunk's kNN top-1, RankMe and feature std every ``MONITOR.EVERY_EPOCHS``.

After every N-th epoch and after the last one, :meth:`Monitor.after_epoch` runs the trunk of the
network the kNN job would evaluate (``BENCHMARK.WEIGHTS_FROM``: the student, or the momentum
teacher where the run has one) in eval mode, without gradients, on held-out images, and puts back
its train mode and every random number generator's state: the training run draws the same numbers
with the monitor on or off. It measures

* **kNN top-1** (%): the ``knn`` job's own code (``vistrain.benchmarks.knn``) on the config
  :func:`knn_config` gives: DATA.TEST scored against a bank of DATA.TRAIN's images read with
  DATA.TEST's transform (a stratified ``MONITOR.LABEL_FRACTION`` of them), ``BENCHMARK.KNN_K`` /
  ``KNN_TEMPERATURE``. Each rank extracts its share, in batches of ``MONITOR.BATCHSIZE_PER_REPLICA``
  (a sharded trunk gathers each unit once per batch); the bank is gathered. So it equals the kNN
  job run on that config and the checkpoint saved at the same iteration. The images are read from
  disk by the first pass and kept in memory when small (:mod:`vistrain.training.held_out`).
  Skipped with one note when the images are not all labelled or DATA.TEST reads other sources
  than DATA.TRAIN.
* **RankMe** (Garrido et al., "RankMe: Assessing the downstream performance of pretrained
  self-supervised representations by their rank", 2023) of the bank's features (N, D) (without
  kNN: of ``MONITOR.NUM_IMAGES`` evenly spaced DATA.TRAIN images): ``exp(-sum_k p_k log p_k)`` with
  ``p_k = s_k / sum_j s_j + eps`` over the singular values s_k; between 1 (every image on one line)
  and min(N, D).
* **feature std** (SimSiam's collapse measure, Chen & He 2021): the std over images of each
  dimension of the L2-normalised features, averaged over dimensions; about 1/sqrt(D) when the
  features spread over the sphere, 0 when every image maps to one point.
* **probe top-1** (%): the online linear probe's (:mod:`vistrain.training.online_probe`, trained
  further at every pass on the kNN's bank) on the kNN's DATA.TEST features.

The verdicts (:mod:`vistrain.training.monitor_rules`): a collapse (RankMe below
``MONITOR.RANKME_MIN`` or 10x below its peak so far, or feature std below ``MONITOR.STD_MIN /
sqrt(D)``, on two passes in a row: early in a healthy run the features can be narrow for a pass
and spread again by the next) prints one warning naming the knobs to try; with
``MONITOR.STOP_ON_COLLAPSE`` every rank stops with :class:`CollapseError` (exit 3, as a divergence;
the checkpoint of that epoch was saved before the pass). A trunk that learns no better than doing
nothing: before a fresh run's first step the kNN measures the trunk as it starts (untrained, or as
loaded), recorded as ``knn_baseline`` at iteration 0; a kNN top-1 not above it by max(2 points,
2 standard errors) on two passes in a row, from the second pass and half of the run on, prints one
warning. Rank 0 writes each pass as one
log line, one metrics.jsonl record (:data:`METRICS`, the verdicts), TensorBoard scalars
``monitor/...`` and, after the last epoch, the curves in ``monitor.png``.
"""

import contextlib
import json
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks import common, label_fraction
from vistrain.benchmarks.knn import build_bank, knn_counts, knn_topk_hits
from vistrain.checkpoint.rng import capture_rng, restore_rng
from vistrain.config import InputError
from vistrain.config.errors import DivergedError
from vistrain.data import build_loader
from vistrain.distributed import comm
from vistrain.fsdp import Backend, backend_of, unwrap
from vistrain.models.trunks import trunk_feature_names
from vistrain.runtime.logger import logger
from vistrain.runtime.pictures import curves_figure, save_picture
from vistrain.runtime.precision import amp_dtype
from vistrain.training.held_out import HeldOutImages
from vistrain.training.monitor_rules import (
    BASELINE,
    KNOBS,
    VIEW_KNOBS,
    History,
    collapse_reasons,
    feature_std,
    no_better_than_baseline,
    prefix_tokens,
    rankme,
    sequence_summary,
)

METRICS = ("knn_top1", "probe_top1", "rankme", "feature_std")  # the per-pass series


class CollapseError(DivergedError):
    """``MONITOR.STOP_ON_COLLAPSE``: the representation collapsed (one line, exit 3)."""

    kind = "collapsed"


# --------------------------------------------------------------------------------------------
# configuration


def feature_name(cfg) -> str:
    """The trunk feature watched: MONITOR.FEATURE, or the first of MODEL.TRUNK.OUT_FEATURES; a
    ViT's "sequence" is watched as its class token "cls" (DINO's and DINOv2's image feature), or
    without one as its mean patch token "avgpool" (:func:`sequence_summary`)."""
    name = cfg.MONITOR.FEATURE or cfg.MODEL.TRUNK.OUT_FEATURES[0]
    if name != "sequence":
        return name
    return "cls" if "cls" in trunk_feature_names(cfg.MODEL.TRUNK) else "avgpool"


def knn_config(cfg):
    """The ``knn`` job's config whose result the monitor reproduces on this run's checkpoints
    (give it MODEL.WEIGHTS_INIT.PARAMS_FILE): DATA.TRAIN read like DATA.TEST, in order, its
    MONITOR.LABEL_FRACTION; both in batches of MONITOR.BATCHSIZE_PER_REPLICA (when set);
    BENCHMARK.FEATURES the watched feature."""
    out = cfg.clone()
    out.defrost()
    out.JOB = "knn"
    data = cfg.DATA.clone()
    data.defrost()
    if cfg.MONITOR.BATCHSIZE_PER_REPLICA:
        data.TEST.BATCHSIZE_PER_REPLICA = cfg.MONITOR.BATCHSIZE_PER_REPLICA
    out.DATA = common.holdout_data_config(data)
    out.DATA.defrost()
    out.DATA.TRAIN.LABEL_FRACTION = cfg.MONITOR.LABEL_FRACTION
    out.BENCHMARK.FEATURES = [feature_name(cfg)]
    out.freeze()
    return out


def is_due(epochs_done: int, num_epochs: int, every: int) -> bool:
    """A pass after every ``every``-th epoch and after the last one (``every`` 0: never)."""
    return every > 0 and (epochs_done % every == 0 or epochs_done == num_epochs)


# --------------------------------------------------------------------------------------------
# the trunk of a training network


def trunk_call(network: nn.Module) -> Callable[[torch.Tensor], Dict[str, torch.Tensor]]:
    """images (N, 3, H, W) -> the trunk's feature dict, for a network as the trainer holds it (an
    SSL model, under DDP or sharded); under ``no_grad`` a sharded one gathers each unit for its
    forward and frees it after, as the kNN job's frozen trunk does."""
    backend, model = backend_of(network), unwrap(network)
    if backend is Backend.BUILTIN:  # the root's own weights gathered around the trunk alone
        return lambda images: network.run_as_forward(network.module.trunk, (images,), {})
    if backend is Backend.TORCH:
        return lambda images: _torch_root_gathered(model, images)
    return model.trunk


def _torch_root_gathered(model: nn.Module, images: torch.Tensor) -> Dict[str, torch.Tensor]:
    model.unshard()  # fully_shard's root: its own weights; the trunk's units gather themselves
    try:
        return model.trunk(images)
    finally:
        model.reshard()


def broadcast_buffers(buffers: List[torch.Tensor]) -> None:
    """Collective: rank 0's values into ``buffers`` on every rank, one broadcast per dtype and device."""
    groups: Dict[tuple, List[torch.Tensor]] = {}
    for buffer in buffers:
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    for group in groups.values():
        flat = torch.cat([buffer.detach().reshape(-1) for buffer in group])
        dist.broadcast(flat, 0)
        for buffer, value in zip(group, torch.split(flat, [b.numel() for b in group])):
            buffer.copy_(value.view_as(buffer))


@contextlib.contextmanager
def watching(network: nn.Module):
    """Eval mode, no gradients, rank 0's BatchNorm buffers (those a checkpoint saves) on every rank;
    afterwards the train mode and every generator's state as they were."""
    training, rng = network.training, capture_rng()
    if comm.get_world_size() > 1:
        broadcast_buffers(list(unwrap(network).buffers()))
    network.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        network.train(training)
        restore_rng(rng)


# --------------------------------------------------------------------------------------------
# the monitor


class Monitor:
    """The monitor of one training run: its passes, their history (peak RankMe, the curves) and
    whether it warned. ``network``: the student or teacher as trained; ``meter``: the run's
    TrainingMeter (it owns metrics.jsonl and TensorBoard)."""

    def __init__(
        self,
        cfg,
        network: nn.Module,
        meter,
        num_epochs: int,
        device: torch.device,
        start: int = 0,
        probe=None,
    ):
        """Collective when ``start`` (the iteration a resumed run starts from) > 0 and the monitor
        is on: the peak RankMe of the passes up to ``start`` (metrics.jsonl), whether the last
        of them met a collapse rule or the baseline rule, their number and the baseline kNN carry
        over. ``probe``: the run's :class:`~vistrain.training.online_probe.OnlineProbe`, tested at
        every pass, or None."""
        self.cfg, self.network, self.meter = cfg, network, meter
        self.num_epochs, self.device, self.start, self.probe = num_epochs, device, start, probe
        self.knn_cfg = knn_config(cfg)
        self.feature = feature_name(cfg)
        self.history = History()
        if start and cfg.MONITOR.EVERY_EPOCHS:
            self.history = _history_before(cfg, start)
        self.test_images = 0  # DATA.TEST images the kNN counted
        self.warned = False
        self.warned_baseline = False
        self.knn_note: Optional[str] = None  # why there is no kNN, once known
        self.labelled = None  # ((bank images, test images), classes): HeldOutImages, built once
        self.unlabelled: Optional[HeldOutImages] = None  # without kNN: DATA.TRAIN images, built once
        self.clock = time.perf_counter()  # the end of the last pass (or the start of training)

    @property
    def peak_rankme(self) -> float:
        return self.history.peak_rankme

    @property
    def suspect(self) -> bool:
        """The last pass met a collapse rule."""
        return self.history.suspect

    def measure_baseline(self) -> None:
        """Collective, before the first step of a fresh run (``start`` 0) when the kNN is on: the
        kNN top-1 of the trunk as it starts, logged and recorded (``knn_baseline``, iteration 0)."""
        if self.start or not self.cfg.MONITOR.EVERY_EPOCHS or not self.cfg.MONITOR.KNN:
            return
        with watching(self.network):
            if backend_of(self.network) is Backend.TORCH:
                self._first_root_forward()
            measured = self._knn(trunk_call(self.network), with_probe=False)
        if measured is None:
            return
        self.history.baseline = (measured["knn_top1"], self.test_images)
        logger.info(
            f"monitor before training: knn_top1 {measured['knn_top1']:.4g} (the trunk as it starts: "
            "a trained trunk must beat it)"
        )
        self.meter.write_values(
            {"iteration": 0, "epoch": -1, BASELINE: measured["knn_top1"], "knn_images": self.test_images},
            "monitor",
        )

    def _first_root_forward(self) -> None:
        """FSDP2 (``fully_shard``) sets its root up in the root's first forward, which must come
        before the trunk runs alone: one on two test images (eval mode, no gradients: no change)."""
        if self.labelled is None:
            self.labelled = self._labelled_images()
        if self.labelled is not None:
            images = next(iter(self.labelled[0][1]))[0]
            self.network(images[:2])

    def after_epoch(self, epochs_done: int, iteration: int) -> None:
        """Collective: a pass when one is due after ``epochs_done`` epochs; curves after the last."""
        if not is_due(epochs_done, self.num_epochs, self.cfg.MONITOR.EVERY_EPOCHS):
            return
        start = time.perf_counter()
        with watching(self.network):
            values, dim = self.measure()
        self.clock, training = time.perf_counter(), start - self.clock
        seconds = {"monitor_seconds": self.clock - start, "train_seconds": training}
        self._report(values, dim, epochs_done, iteration, seconds)
        if epochs_done == self.num_epochs:
            self._draw(iteration)

    def measure(self) -> Tuple[Dict[str, float], int]:
        """Collective (call inside :func:`watching`): ({knn_top1?, rankme, feature_std}, D)."""
        trunk = trunk_call(self.network)
        measured = self._knn(trunk) if self.cfg.MONITOR.KNN and self.knn_note is None else None
        values = {}
        if measured is None:
            bank = self._unlabelled_features(trunk)
        else:
            bank = measured.pop("bank")
            values.update(measured)
        values.update(rankme=rankme(bank), feature_std=feature_std(bank))
        return values, bank.shape[1]

    def _extract(self, trunk, images: HeldOutImages):
        """(features (N, D) of the watched feature, labels (N,), indices (N,)) of ``images``."""
        model = self.network.module if backend_of(self.network) is Backend.BUILTIN else unwrap(self.network)
        bench, prefix = self.cfg.BENCHMARK, prefix_tokens(model.trunk)
        summarised = lambda x: sequence_summary(trunk(x), self.feature, prefix)
        feats, labels, indices = common.extract_batches(
            summarised, images, [self.feature], bench.POOL_SIZE, amp_dtype(self.cfg.MODEL), self.device,
            bench.FEATURE_VIEWS,
        )  # fmt: skip
        return feats[self.feature], labels, indices

    def _knn(self, trunk, with_probe: bool = True) -> Optional[Dict[str, object]]:
        """{"bank": the gathered bank's features (N, D), "knn_top1": %, ["probe_top1": % of the
        online probe on the same test features]}, or None (and a note) without labels."""
        bench = self.cfg.BENCHMARK
        if self.labelled is None:
            self.labelled = self._labelled_images()
            if self.labelled is None:
                return None
        (train, test), num_classes = self.labelled
        train_feats, train_labels, train_indices = self._extract(trunk, train)
        test_feats, test_labels, test_indices = self._extract(trunk, test)
        bank, bank_labels = build_bank(F.normalize(train_feats, dim=1), train_labels, train_indices)
        hits = knn_topk_hits(
            F.normalize(test_feats, dim=1), test_labels, bank, bank_labels, num_classes, bench.KNN_K,
            bench.KNN_TEMPERATURE, bench.KNN_CHUNK_SIZE,
        )  # fmt: skip
        counts = knn_counts(hits, test_indices)
        # un-normalised, for RankMe and the probe
        _, (raw, raw_labels) = common.gather_unique(train_indices, train_feats, train_labels)
        result = common.summarise(counts[None], ["knn"])["knn"]  # the knn job's arithmetic
        self.test_images = result["num_images"]
        measured = {"bank": raw, "knn_top1": result["top1"]}
        if self.probe is not None and with_probe:  # its pass: fit on the bank, score the test images
            self.probe.fit(raw, raw_labels)
            measured["probe_top1"] = self.probe.top1(test_feats, test_labels, test_indices, raw)
        return measured

    def _labelled_images(self):
        """((bank images, test images), classes) of :func:`knn_config`, or None with a note."""
        cfg = self.knn_cfg
        if list(cfg.DATA.TRAIN.DATA_SOURCES) != list(cfg.DATA.TEST.DATA_SOURCES):
            return self._no_knn(
                f"DATA.TEST reads {list(cfg.DATA.TEST.DATA_SOURCES)}, not DATA.TRAIN's sources "
                f"{list(cfg.DATA.TRAIN.DATA_SOURCES)}"
            )
        test = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=self.device)
        try:
            train = label_fraction.labelled_train_loader(cfg, self.device)[0]
            num_classes = common.num_classes(train.dataset, test.dataset)
        except (InputError, ValueError) as error:
            return self._no_knn(str(error).splitlines()[0])
        return (HeldOutImages(train, self.device), HeldOutImages(test, self.device)), num_classes

    def _no_knn(self, why: str) -> None:
        self.knn_note = why
        logger.info(f"monitor: no kNN ({why}); RankMe and feature std on DATA.TRAIN's images")
        return None

    def _unlabelled_features(self, trunk) -> torch.Tensor:
        """Features (N, D) of MONITOR.NUM_IMAGES evenly spaced DATA.TRAIN images (read like DATA.TEST)."""
        if self.unlabelled is None:
            data = self.knn_cfg.DATA
            total = len(build_loader(data, "TRAIN", seed=0, device=self.device).dataset)
            count = min(total, self.cfg.MONITOR.NUM_IMAGES)
            indices = torch.linspace(0, total - 1, count).round().long().unique().tolist()
            loader = common.ordered_loader(data, "TRAIN", self.cfg.SEED_VALUE, self.device, indices)
            self.unlabelled = HeldOutImages(loader, self.device)
        feats, _, positions = self._extract(trunk, self.unlabelled)
        return common.gather_unique(positions, feats)[1][0]

    # -- reporting ----------------------------------------------------------------------------
    def _report(self, values: Dict[str, float], dim: int, epochs_done: int, iteration: int, seconds) -> None:
        """``seconds``: this pass's and the training's since the previous pass (or the start)."""
        monitor, history = self.cfg.MONITOR, self.history
        history.peak_rankme = max(history.peak_rankme, values["rankme"])
        history.passes += 1
        line = " ".join(f"{name} {values[name]:.4g}" for name in METRICS if name in values)
        logger.info(
            f"monitor epoch {epochs_done}: {line} ({seconds['monitor_seconds']:.1f} s; training since "
            f"the last pass {seconds['train_seconds']:.1f} s)"
        )
        reasons = collapse_reasons(values, self.peak_rankme, dim, monitor.RANKME_MIN, monitor.STD_MIN)
        record = {"iteration": iteration, "epoch": epochs_done - 1, **values, **seconds}
        no_better = self._no_better(values, epochs_done)
        if history.baseline is not None and "knn_top1" in values:
            record["no_better_than_baseline"] = int(bool(no_better))
        self.meter.write_values({**record, "collapse_suspect": int(bool(reasons))}, "monitor")
        told, history.no_better = history.no_better and bool(no_better), bool(no_better)
        if told and not self.warned_baseline and comm.is_main_process():
            logger.warning(
                f"monitor: the trunk learns no better than doing nothing: {no_better}, as on the pass "
                f"before; {VIEW_KNOBS}"
            )
        self.warned_baseline = self.warned_baseline or told
        confirmed, history.suspect = history.suspect and bool(reasons), bool(reasons)
        if not confirmed:
            return
        what = f"the representation collapsed by epoch {epochs_done} ({reasons}, as on the pass before)"
        if monitor.STOP_ON_COLLAPSE:  # the same numbers on every rank: every rank stops here
            raise CollapseError(
                f"{what}; checkpoints in {self.cfg.CHECKPOINT.DIR} kept (MONITOR.STOP_ON_COLLAPSE); {KNOBS}",
                agreed=True,
            )
        if not self.warned and comm.is_main_process():
            logger.warning(f"monitor: {what}; {KNOBS}")
        self.warned = True

    def _no_better(self, values: Dict[str, float], epochs_done: int) -> str:
        """:func:`no_better_than_baseline` of this pass ("" without a baseline or a kNN)."""
        if self.history.baseline is None or "knn_top1" not in values:
            return ""
        baseline, num_images = self.history.baseline
        progress = epochs_done / self.num_epochs
        return no_better_than_baseline(
            values["knn_top1"], baseline, num_images, self.history.passes, progress
        )

    def _draw(self, iteration: int) -> None:
        """Rank 0: monitor.png from every monitor record in metrics.jsonl (earlier runs of a
        resumed run included): every numeric series they hold, with real axes (matplotlib; without
        it one note and no picture)."""
        if self.meter.writer is None:
            return
        # a resumed run's passes replace those its earlier run made past the checkpoint
        records = list({r["epoch"]: r for r in _monitor_records(self.cfg.CHECKPOINT.DIR)}.values())
        try:
            image = curves_figure(records, f"monitor of {self.feature}")
        except InputError as error:  # matplotlib missing: the curves are in metrics.jsonl and TensorBoard
            logger.info(f"monitor.png not drawn: {error}")
            return
        save_picture(
            image, self.cfg.CHECKPOINT.DIR, "monitor.png", self.meter.writer, "monitor/curves", iteration
        )


def _monitor_records(run_dir: str, with_baseline: bool = False) -> List[dict]:
    """The monitor's pass records of ``run_dir``/metrics.jsonl (and its baseline records, when
    asked), in the order written (none: [])."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    keys = ('"rankme"', f'"{BASELINE}"') if with_baseline else ('"rankme"',)
    with open(path) as lines:
        return [json.loads(line) for line in lines if any(key in line for key in keys)]


def _history_before(cfg, start: int) -> History:
    """Collective: the :class:`History` up to iteration ``start``, as rank 0 reads metrics.jsonl
    (the file is rank 0's), on every rank (their decisions agree)."""
    history = History()
    if comm.is_main_process():
        history = History.of(_monitor_records(cfg.CHECKPOINT.DIR, with_baseline=True), start)
    return comm.all_gather_object(history)[0]
