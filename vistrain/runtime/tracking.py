"""Weights & Biases as a second sink for a run's scalars and images (``LOGGING.WANDB``; rank 0 only).

Off by default. With ``LOGGING.WANDB.ENABLED`` rank 0's :class:`vistrain.runtime.logger.RunWriter`
hands every TensorBoard scalar and image to a :class:`WandbSink` as well: the same tags, the
run's iteration as their x axis (W&B's ``step_metric``, so scalars written out of order, such as
a monitor's pass after the loss lines, are kept). ``wandb`` is imported only here, when enabled
(``pip install "vistrain[wandb]"``; the config check names it when missing).

The W&B run lives in the run folder (``<CHECKPOINT.DIR>/wandb/``); its id is kept in
``<CHECKPOINT.DIR>/wandb/vistrain_run_id``, so a resumed run (the same folder) continues the
same W&B run. ``MODE: offline`` (or ``WANDB_MODE=offline`` with ``MODE: ""``) needs no network
nor account: ``wandb sync <CHECKPOINT.DIR>/wandb/offline-run-*`` uploads it later.
"""

import dataclasses
import os
import uuid
from typing import Dict, Optional

import numpy as np

from vistrain.config.errors import ConfigError

ID_FILE = "vistrain_run_id"
INSTALL = 'LOGGING.WANDB.ENABLED needs wandb: pip install "vistrain[wandb]"'


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """What a :class:`WandbSink` needs of the run: ``LOGGING.WANDB``'s values and the resolved config."""

    project: str
    name: str  # "": the run folder's name
    mode: str  # online | offline | disabled | "": wandb's own default (WANDB_MODE, else online)
    job: str  # JOB: W&B's job_type
    config: dict  # the resolved config, as plain values


def wandb_settings(cfg) -> Optional[WandbSettings]:
    """The :class:`WandbSettings` of ``cfg`` (the whole config), None unless LOGGING.WANDB.ENABLED."""
    section = cfg.LOGGING.WANDB
    if not section.ENABLED:
        return None
    from vistrain.config.loader import load_yaml

    return WandbSettings(section.PROJECT, section.NAME, section.MODE, cfg.JOB, load_yaml(cfg.dump()))


class WandbSink:
    """A W&B run in ``run_dir`` receiving scalars and images; rows are sent per iteration.

    Values of one iteration are gathered and logged together when the iteration changes or on
    :meth:`flush`, each row with ``iteration`` as its x axis.
    """

    def __init__(self, settings: WandbSettings, run_dir: str):
        try:
            import wandb
        except ImportError:
            raise ConfigError(INSTALL) from None
        self.wandb = wandb
        folder = os.path.join(os.path.abspath(run_dir), "wandb")
        os.makedirs(folder, exist_ok=True)
        try:
            self.run = wandb.init(
                project=settings.project,
                name=settings.name or os.path.basename(os.path.abspath(run_dir)),
                mode=settings.mode or None,
                dir=os.path.abspath(run_dir),
                id=_run_id(folder),
                resume="allow",
                job_type=settings.job,
                config=settings.config,
                settings=wandb.Settings(silent=True, console="off"),
            )
        except wandb.errors.Error as error:  # not logged in, no network...: the user's to fix
            first = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
            raise ConfigError(
                f"LOGGING.WANDB: Weights & Biases could not start a run: {first}; or set "
                "LOGGING.WANDB.MODE=offline (no account or network needed)"
            ) from None
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")
        self.row: Dict[str, object] = {}
        self.iteration: Optional[int] = None

    @property
    def where(self) -> str:
        """Where the run's files are (an offline run's folder to ``wandb sync``)."""
        return self.run.dir.rsplit(os.sep + "files", 1)[0]

    def add_scalar(self, tag: str, value: float, iteration: int) -> None:
        self._at(iteration)
        self.row[tag] = float(value)

    def add_image(self, tag: str, image: np.ndarray, iteration: int) -> None:
        """``image``: uint8 (H, W, 3)."""
        self._at(iteration)
        self.row[tag] = self.wandb.Image(image)

    def flush(self) -> None:
        if self.row:
            self.run.log({**self.row, "iteration": self.iteration})
            self.row = {}

    def close(self) -> None:
        """Finish the run and wait until W&B's service has written it: a forked rank leaves by
        ``os._exit``, which skips the wait W&B would otherwise make at exit."""
        self.flush()
        self.run.finish()
        self.wandb.teardown()

    def _at(self, iteration: int) -> None:
        if iteration != self.iteration:
            self.flush()
            self.iteration = int(iteration)


def _run_id(folder: str) -> str:
    """The W&B run id of this run folder: the one saved in ``folder`` by an earlier run, else a new one."""
    path = os.path.join(folder, ID_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            saved = f.read().strip()
        if saved:
            return saved
    run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
    with open(path, "w") as f:
        f.write(run_id)
    return run_id
