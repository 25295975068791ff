"""The online linear probe: a linear classifier trained during pretraining on the trunk's detached
features of the labelled training images, tested on DATA.TEST at every monitor pass.

As solo-learn's online classifier (da Costa et al., "solo-learn: A Library of Self-supervised
Methods for Visual Representation Learning", JMLR 2022) it has its own optimizer and weights that
no gradient of the SSL loss reaches, and it follows the trunk through the run. It trains on the
monitor's schedule, on the monitor's features (``vistrain.training.monitor``): at every pass,
on the kNN's bank (DATA.TRAIN's labelled images read like DATA.TEST, ``MONITOR.LABEL_FRACTION`` of
them, the feature ``MONITOR.FEATURE`` of the trunk ``BENCHMARK.WEIGHTS_FROM`` names, in eval
mode), warm-started from the previous pass, then scores the kNN's test features. Per pass, with
X (N, D) the bank's features and y their labels::

    x_hat = (x - mean(X)) / sqrt(var(X) + 1e-5)       the bank's statistics (BatchNorm without affine)
    MONITOR.PROBE_EPOCHS epochs of SGD (momentum 0.9, no weight decay) on CE(W x_hat + b, y),
    batches of 256 in an order drawn from the probe's generator, lr MONITOR.PROBE_LR x (1 + cos(pi k / K)) / 2
    over the pass's K steps

Every rank holds the whole bank (the kNN gathers it) and the same generator, so every rank trains
the same probe without communicating. It lives outside the (sharded or DDP) model, draws from its
own generator (seeded ``mix_seed(SEED_VALUE, PROBE_STREAM)``, never the run's) inside the
monitor's pass (which puts back every generator of the run), and goes into every checkpoint
(``extra["probe"]``, resumed on any world size): training is the same with it on or off.

Why not at every training step, on the trunk output of the step (solo-learn's way): that feature
is the student's in train mode on augmented, possibly masked crops, not the monitor's, and a probe
fed on it trails the kNN by tens of points early in a run (docs/getting-started.md).
"""

import copy
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks import common
from vistrain.config.errors import DataError
from vistrain.data import mix_seed
from vistrain.distributed import comm

PROBE_STREAM = 0x9B0BE  # the probe's generator: mix_seed(SEED_VALUE, PROBE_STREAM)
BATCH = 256
MOMENTUM = 0.9
EPS = 1e-5


def cosine_lr(base: float, step: int, total: int) -> float:
    """``base x (1 + cos(pi k / K)) / 2`` at step k of K."""
    return base * 0.5 * (1.0 + math.cos(math.pi * min(step / max(total, 1), 1.0)))


def standardised(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``x`` (N, D) minus the mean of ``reference`` (M, D), over its std (+ eps), per dimension."""
    mean = reference.mean(0)
    var = reference.var(0, unbiased=False)
    return (x - mean) / torch.sqrt(var + EPS)


class OnlineProbe:
    """The probe of one run: ``Linear(D, classes)`` (built at the first :meth:`fit`, D the width of
    the features it reads), its SGD and its generator."""

    def __init__(self, classes: int, cfg, device: torch.device):
        self.classes, self.device = classes, device
        self.lr, self.epochs = float(cfg.MONITOR.PROBE_LR), int(cfg.MONITOR.PROBE_EPOCHS)
        self.generator = torch.Generator().manual_seed(mix_seed(cfg.SEED_VALUE, PROBE_STREAM))
        self.linear: Optional[nn.Linear] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None

    def _build(self, dim: int) -> None:
        # on the meta device first: nn.Linear's own initialisation would draw from the run's RNG
        self.linear = nn.Linear(dim, self.classes, device="meta").to_empty(device=self.device)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(self.classes, dim, generator=self.generator) * 0.01)
            self.linear.bias.zero_()
        self.optimizer = torch.optim.SGD(self.linear.parameters(), lr=self.lr, momentum=MOMENTUM)

    def fit(self, bank: torch.Tensor, labels: torch.Tensor) -> None:
        """``MONITOR.PROBE_EPOCHS`` epochs on the bank's features (N, D) float32 and labels (N,)
        int64, the same on every rank (no collective)."""
        if self.linear is None:
            self._build(bank.shape[1])
        device = self.device
        x, y = standardised(bank.to(device).float(), bank.to(device).float()), labels.to(device)
        steps = self.epochs * math.ceil(x.shape[0] / BATCH)
        step = 0
        with torch.enable_grad():
            for _ in range(self.epochs):
                order = torch.randperm(x.shape[0], generator=self.generator).to(device)
                for rows in order.split(BATCH):
                    for group in self.optimizer.param_groups:
                        group["lr"] = cosine_lr(self.lr, step, steps)
                    loss = F.cross_entropy(self.linear(x[rows]), y[rows])
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    self.optimizer.step()
                    step += 1

    @torch.no_grad()
    def top1(
        self, features: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, bank: torch.Tensor
    ) -> float:
        """Collective: top-1 (%) over every rank's test images, each data set index once.
        ``features`` (N_r, D) float32, ``labels`` / ``indices`` (N_r,) int64: this rank's share;
        ``bank``: the features :meth:`fit` read (their statistics standardise these)."""
        device = self.device
        logits = self.linear(standardised(features.to(device).float(), bank.to(device).float()))
        hits = logits.argmax(dim=1) == labels.to(device)
        keep = common.unique_on_this_rank(indices.to(device))
        counts = torch.stack([hits[keep].sum(), keep.sum()]).to(torch.float64)
        hit, total = comm.all_reduce_sum(counts).tolist()
        return 100.0 * hit / max(total, 1.0)

    def state_dict(self) -> dict:
        """Equal on every rank: the weights, SGD's momentum, the generator ({} before the first fit)."""
        if self.linear is None:
            return {}
        return {
            "linear": {k: v.detach().cpu().clone() for k, v in self.linear.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # not the live momentum
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self._build(state["linear"]["weight"].shape[1])
        self.linear.load_state_dict(state["linear"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])


def build_online_probe(cfg, dataset, device: torch.device) -> Optional[OnlineProbe]:
    """The run's probe where ``MONITOR.ONLINE_PROBE`` is on and the monitor's kNN runs (its bank
    and test features are the probe's), else None. ``dataset``: DATA.TRAIN's (its labels give the
    classes; without a label on every image the kNN, and so the probe, is skipped)."""
    monitor = cfg.MONITOR
    if not (monitor.ONLINE_PROBE and monitor.EVERY_EPOCHS and monitor.KNN):
        return None
    try:
        classes = common.check_labels(dataset, "TRAIN")
    except (DataError, AttributeError):  # not all labelled, or a source that cannot tell
        return None
    return OnlineProbe(classes, cfg, device)
