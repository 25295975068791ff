"""Watching a run: console/file log lines, metrics.jsonl and TensorBoard scalars (rank 0 writes).

Every scalar and image of a run goes through rank 0's :class:`RunWriter`: TensorBoard, and with
``LOGGING.WANDB.ENABLED`` a Weights & Biases run too (:mod:`vistrain.runtime.tracking`).

Per iteration the trainer only adds tensors on the device (no host sync) and the seconds it waited
for the batch (:func:`timed`): ``data_time`` (mean wait per iteration) and ``data_share`` (the
part of the window's wall time spent waiting for data, mean over ranks) say whether the data
pipeline keeps up. Every LOG_FREQUENCY
iterations :meth:`TrainingMeter.log` reduces the window over ranks in one all-reduce and rank 0
writes one line, one JSON object and the TensorBoard scalars. The same reduction catches a NaN/inf
loss on any rank in the window and stops every rank with the same error. Under fp16 loss scaling
the record also holds the scale and the steps skipped on overflow so far (``loss_scale``,
``skipped_steps``; the same on every rank).
"""

import datetime
import json
import logging
import os
import sys
import time
from typing import Iterable, Iterator, Optional, Tuple

import numpy as np
import torch

from vistrain.config.errors import DivergedError
from vistrain.config.words import plural
from vistrain.distributed import comm
from vistrain.fsdp.memory import peak_rss_mib
from vistrain.runtime.precision import LossScaling
from vistrain.runtime.tracking import WandbSettings, WandbSink

logger = logging.getLogger("vistrain")
LOG_FILE_ONLY = {"log_file_only": True}  # logger.info(line, extra=LOG_FILE_ONLY): log.txt, not the console


def setup_logging(run_dir: str) -> logging.Logger:
    """INFO lines from rank 0 to stdout and ``run_dir/log.txt``; other ranks log warnings only."""
    logger.handlers.clear()
    logger.propagate = False
    if not comm.is_main_process():
        logger.setLevel(logging.WARNING)
        logger.addHandler(logging.StreamHandler(sys.stderr))
        return logger
    logger.setLevel(logging.INFO)
    os.makedirs(run_dir, exist_ok=True)
    fmt = logging.Formatter("[%(asctime)s vistrain] %(message)s", datefmt="%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.addFilter(lambda record: not getattr(record, "log_file_only", False))
    for handler in (console, logging.FileHandler(os.path.join(run_dir, "log.txt"))):
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    return logger


def peak_memory_mib(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors, or on CPU the peak resident set of this process (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mib()


class RunWriter:
    """Rank 0's sinks of a run's scalars and images: TensorBoard (``run_dir/tb``) and, given
    ``tracking`` (``vistrain.runtime.tracking.wandb_settings``), a W&B run in the run folder.
    The part of TensorBoard's ``SummaryWriter`` API that vistrain writes with."""

    def __init__(self, run_dir: str, tracking: Optional[WandbSettings] = None):
        from torch.utils.tensorboard import SummaryWriter  # slow import: rank 0 only

        self.tensorboard = SummaryWriter(log_dir=os.path.join(run_dir, "tb"))
        self.wandb = WandbSink(tracking, run_dir) if tracking is not None else None
        if self.wandb is not None:
            mode = tracking.mode or os.environ.get("WANDB_MODE", "online")
            logger.info(f"Weights & Biases: {mode} run {self.wandb.run.id} in {self.wandb.where}")

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.add_scalar(tag, value, step)

    def add_image(self, tag: str, image: np.ndarray, step: int, dataformats: str = "CHW") -> None:
        """``image`` uint8 in ``dataformats`` order ("CHW" or "HWC", as TensorBoard takes it)."""
        self.tensorboard.add_image(tag, image, step, dataformats=dataformats)
        if self.wandb is not None:
            self.wandb.add_image(tag, image if dataformats == "HWC" else np.moveaxis(image, 0, -1), step)

    def flush(self) -> None:
        self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.flush()

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NonFiniteLossError(DivergedError):
    """The training loss (or the weights) became NaN or infinite: one line, exit 3 (see
    :func:`divergence_message`)."""


def divergence_message(what: str, iteration: int, run_dir: str) -> str:
    """``what`` ("loss became nan"...) by ``iteration``, the last good checkpoint (no save of a
    diverged run replaces it) and what to change."""
    from vistrain.checkpoint import find_latest_checkpoint  # checkpoint is a lower layer

    latest = find_latest_checkpoint(run_dir)
    kept = f"last good checkpoint {latest} kept" if latest else f"no checkpoint in {run_dir} yet"
    return (
        f"{what} by iteration {iteration}; {kept}; lower OPTIMIZER.param_schedulers.lr.base_value, "
        "set OPTIMIZER.clip_grad_norm or check the data, then rerun"
    )


def timed(batches: Iterable) -> Iterator[Tuple[object, float]]:
    """Yield ``(batch, seconds waited for it)`` from ``batches`` (a DataLoader): the step's wait
    for data, apart from its compute."""
    iterator = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield batch, time.perf_counter() - start


class TrainingMeter:
    """Accumulates per-iteration loss and image counts; reduces and writes them every ``log_frequency``."""

    # slots of the window tensor summed over ranks in one all-reduce
    _LOSS_SUM, _ITERS, _IMAGES, _SKIPPED, _NONFINITE, _LAST_LOSS, _NAN, _DATA_TIME = range(8)

    def __init__(
        self,
        run_dir: str,
        log_frequency: int,
        total_iterations: int,
        device: torch.device,
        scaling: Optional[LossScaling] = None,
        console: bool = True,
        tracking: Optional[WandbSettings] = None,
    ):
        """``console`` False: the periodic lines go to log.txt only (metrics and TensorBoard as ever);
        ``tracking``: a W&B run beside TensorBoard (:class:`RunWriter`)."""
        if log_frequency < 1:
            raise ValueError(f"LOG_FREQUENCY must be >= 1, got {log_frequency}")
        self.run_dir, self.log_frequency, self.total = run_dir, log_frequency, total_iterations
        self.device, self.scaling, self.console = device, scaling, console
        self.window = torch.zeros(8, dtype=torch.float64, device=device)
        self.data_time = 0.0  # seconds this rank waited for data in the window (a host number)
        self.window_start = self.run_start = time.perf_counter()
        self.images_seen = 0.0  # this run, all ranks
        self.skipped_total = 0.0
        self.last_loss: Optional[float] = None
        self.writer = self.metrics_file = None
        if comm.is_main_process():
            self.writer = RunWriter(run_dir, tracking)
            self.metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # noqa: SIM115  closed by close()

    def update(
        self, loss: torch.Tensor, num_images: int, num_skipped: int = 0, data_time: float = 0.0
    ) -> None:
        """Add one iteration's (this rank's) loss, batch size and seconds waited for the batch. No host sync."""
        self.data_time += data_time
        loss = loss.detach().to(torch.float64)
        finite = torch.isfinite(loss)
        w = self.window
        w[self._LOSS_SUM] += torch.where(finite, loss, torch.zeros_like(loss))
        w[self._NONFINITE] += (~finite).to(torch.float64)
        w[self._NAN] += torch.isnan(loss).to(torch.float64)
        w[self._LAST_LOSS] = loss
        w[self._ITERS] += 1
        w[self._IMAGES] += num_images
        w[self._SKIPPED] += num_skipped

    def should_log(self, iteration: int) -> bool:
        """``iteration`` counts completed iterations (1-based); the last one is always logged."""
        return iteration % self.log_frequency == 0 or iteration == self.total

    def check_finite(self, iteration: int, epoch: int) -> None:
        """Collective: raise on every rank if any rank saw a NaN/inf loss in the current window."""
        bad = comm.all_reduce_sum(self.window[[self._NONFINITE, self._NAN]].clone()).tolist()
        if bad[0] > 0:
            value = "nan" if bad[1] > 0 else "inf"
            raise NonFiniteLossError(
                divergence_message(f"loss became {value}", iteration, self.run_dir), agreed=True
            )

    def log(self, iteration: int, epoch: int, num_epochs: int, lr: float) -> None:
        """Collective: reduce the window over ranks; rank 0 writes the line, metrics.jsonl and TensorBoard."""
        self.check_finite(iteration, epoch)
        self.window[self._DATA_TIME] = self.data_time
        self.data_time = 0.0
        window = comm.all_reduce_sum(self.window.clone()).tolist()
        peak = comm.all_reduce_max(torch.tensor([peak_memory_mib(self.device)], device=self.device)).item()
        now = time.perf_counter()
        elapsed, self.window_start = now - self.window_start, now
        self.window.zero_()
        world = comm.get_world_size()
        iters = window[self._ITERS] / world
        self.images_seen += window[self._IMAGES]
        self.skipped_total += window[self._SKIPPED]
        self.last_loss = window[self._LAST_LOSS] / world
        record = {
            "iteration": iteration,
            "epoch": epoch,
            "loss": self.last_loss,  # this iteration, mean over ranks
            "loss_avg": window[self._LOSS_SUM] / max(window[self._ITERS], 1),  # window mean
            "lr": lr,
            "images_per_sec": window[self._IMAGES] / max(elapsed, 1e-9),
            "eta_seconds": (self.total - iteration) * elapsed / max(iters, 1),
            "peak_mem_mib": peak,
            "skipped_images": int(self.skipped_total),
            "data_time": window[self._DATA_TIME] / max(window[self._ITERS], 1),  # s per iteration
            "data_share": min(1.0, window[self._DATA_TIME] / world / max(elapsed, 1e-9)),
        }
        if self.scaling is not None:
            record.update(loss_scale=self.scaling.scale, skipped_steps=self.scaling.skipped_steps)
        if comm.is_main_process():
            self._write(record, num_epochs)

    def _write(self, record: dict, num_epochs: int) -> None:
        eta = datetime.timedelta(seconds=int(record["eta_seconds"]))
        skipped = f"  skipped {record['skipped_images']}" if record["skipped_images"] else ""
        if "loss_scale" in record:
            skipped += f"  scale {record['loss_scale']:g} ({record['skipped_steps']} steps skipped)"
        logger.info(
            f"epoch {record['epoch'] + 1}/{num_epochs}  it {record['iteration']}/{self.total}  "
            f"loss {record['loss']:.4f} (avg {record['loss_avg']:.4f})  lr {record['lr']:.4g}  "
            f"{record['images_per_sec']:.1f} img/s  data {record['data_time']:.3f}s ({record['data_share']:.0%})  "
            f"eta {eta}  mem {record['peak_mem_mib']:.0f} MiB{skipped}",
            extra=None if self.console else LOG_FILE_ONLY,
        )
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        names = (
            "loss",
            "loss_avg",
            "lr",
            "images_per_sec",
            "data_share",
            "data_time",
            "peak_mem_mib",
            "skipped_images",
        )
        for name in names + ("loss_scale", "skipped_steps"):
            if name in record:
                self.writer.add_scalar(f"train/{name}", record[name], record["iteration"])
        self.writer.flush()

    def write_values(self, record: dict, prefix: str) -> None:
        """Rank 0: ``record`` (``iteration``, ``epoch`` and numbers measured beside the loss, such as
        the monitor's) as one more metrics.jsonl line, each number as TensorBoard ``<prefix>/<name>``."""
        if self.writer is None:
            return
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        for name, value in record.items():
            if name not in ("iteration", "epoch"):
                self.writer.add_scalar(f"{prefix}/{name}", value, record["iteration"])
        self.writer.flush()

    def summary(self) -> None:
        """Rank 0: one closing line (time, final loss, throughput); closes the files."""
        total = time.perf_counter() - self.run_start
        if comm.is_main_process():
            loss = "n/a" if self.last_loss is None else f"{self.last_loss:.4f}"
            logger.info(
                f"done in {datetime.timedelta(seconds=int(total))}: final loss {loss}, "
                f"{self.images_seen / max(total, 1e-9):.1f} img/s overall"
                + (
                    f", skipped {plural(int(self.skipped_total), 'corrupt image')}"
                    if self.skipped_total
                    else ""
                )
            )
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.metrics_file.close()
            self.writer = self.metrics_file = None
