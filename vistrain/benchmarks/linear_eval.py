"""Linear evaluation of a frozen trunk, one rank: ``linear_eval(cfg)`` (``ENGINE_NAME: linear_eval``).

The standard protocol (Goyal et al., "Scaling and Benchmarking Self-Supervised Visual
Representation Learning", 2019, as in VISSL): the pretrained trunk is frozen and, for every
feature in ``BENCHMARK.FEATURES``, a linear classifier ``Linear(BatchNorm1d(f, affine=False))``
is trained on the pooled feature ``f`` with SGD (+ nesterov) and a step or cosine schedule. All
heads train together from one pass of the trunk per batch, so evaluating several stages costs one
trunk forward. Top-1/top-5 on ``DATA.TEST`` are written to the log, TensorBoard
(``linear_eval/<feature>/top1``) and ``CHECKPOINT.DIR/metrics.json``; the trained heads to
``CHECKPOINT.DIR/linear_heads.pt``.

Distributed: the heads are data parallel (DDP, sync BatchNorm when configured); the trunk is
either replicated or sharded by our engine (``AUTO_SETUP_FSDP``). Test counts are de-duplicated
(the sampler pads with repeats) and summed over ranks, so they are exact for any world size.
"""

import dataclasses
import os
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks import common
from vistrain.data import build_loader, set_epoch
from vistrain.distributed import comm
from vistrain.fsdp import unwrap
from vistrain.optim import build_lr_schedule, build_optimizer, set_lr
from vistrain.runtime.logger import TrainingMeter, logger
from vistrain.runtime.parallel import parallelize
from vistrain.runtime.run_setup import record_config, start_run


class LinearHeads(nn.Module):
    """One ``BatchNorm1d(D, affine=False) -> Linear(D, num_classes)`` per feature.

    ``forward({name: (N, D_name) float32})`` -> ``{name: logits (N, num_classes)}``. The parameter-free
    BatchNorm standardises features whose scales differ wildly between stages, so one learning
    rate suits every head (VISSL's "eval_mlp").
    """

    def __init__(self, dims: Dict[str, int], num_classes: int):
        super().__init__()
        self.heads = nn.ModuleDict()
        for name, dim in dims.items():
            linear = nn.Linear(dim, num_classes)
            nn.init.normal_(linear.weight, std=0.01)
            nn.init.zeros_(linear.bias)
            self.heads[name] = nn.Sequential(nn.BatchNorm1d(dim, affine=False), linear)

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {name: head(features[name]) for name, head in self.heads.items()}


@dataclasses.dataclass
class FrozenFeatures:
    """Batch -> (pooled trunk features {name: (B, D) float32}, labels (B,)) on ``device``."""

    trunk: nn.Module
    names: List[str]
    pool_size: int
    dtype: Optional[torch.dtype]  # autocast of the trunk forward; None: fp32
    device: torch.device

    def __call__(self, batch: dict):
        images, labels = batch["crops"][0].to(self.device), batch["label"].to(self.device)
        return common.trunk_features(self.trunk, images, self.names, self.pool_size, self.dtype), labels


def linear_eval(cfg) -> None:
    """Train linear heads on the frozen trunk's features of DATA.TRAIN, evaluate on DATA.TEST."""
    start = time.perf_counter()
    run_dir = cfg.CHECKPOINT.DIR
    device = start_run(cfg)

    # ---- build
    train_loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device)
    test_loader = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=device)
    num_classes = common.num_classes(train_loader.dataset, test_loader.dataset)
    if len(train_loader) == 0:
        raise ValueError("DATA.TRAIN yields no full batch per rank: add data or lower BATCHSIZE_PER_REPLICA")
    trunk, dims = common.build_frozen_trunk(cfg, device)
    record_config(cfg)  # built and loaded: the job really starts
    source = FrozenFeatures(trunk, list(dims), cfg.BENCHMARK.POOL_SIZE, common.amp_dtype(cfg), device)
    heads = parallelize(LinearHeads(dims, num_classes), _heads_model_config(cfg), device)
    logger.info(
        f"linear evaluation of {source.names} (dims {list(dims.values())}, {num_classes} classes): "
        f"{cfg.OPTIMIZER.num_epochs} epochs x {len(train_loader)} iterations on {comm.get_world_size()} ranks"
    )

    # ---- train, evaluate, report
    meter = TrainingMeter(run_dir, cfg.LOG_FREQUENCY, cfg.OPTIMIZER.num_epochs * len(train_loader), device)
    iterations = train_heads(source, heads, train_loader, cfg.OPTIMIZER, meter)
    train_seconds = time.perf_counter() - start
    results = evaluate(source, heads, test_loader)
    for name in source.names:
        results[name]["dim"] = dims[name]
    record = {
        "engine": "linear_eval",
        "weights": cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE,
        "num_classes": num_classes,
        "epochs": cfg.OPTIMIZER.num_epochs,
        "iterations": iterations,
        "world_size": comm.get_world_size(),
        "results": results,
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - start,
    }
    _report(run_dir, record, meter.writer)
    if comm.is_main_process():
        torch.save(unwrap(heads).state_dict(), os.path.join(run_dir, "linear_heads.pt"))
    meter.summary()


def train_heads(source: FrozenFeatures, heads: nn.Module, loader, opt_cfg, meter: TrainingMeter) -> int:
    """``opt_cfg.num_epochs`` epochs of SGD on the heads (cross-entropy summed over heads).

    Returns the number of iterations. The trunk only ever runs under ``no_grad`` in eval mode.
    """
    optimizer = build_optimizer(opt_cfg, heads)
    lr_schedule = build_lr_schedule(opt_cfg, len(loader))
    iteration = 0
    for epoch in range(opt_cfg.num_epochs):
        set_epoch(loader, epoch)
        heads.train()
        for batch in loader:
            lr = lr_schedule(iteration)
            set_lr(optimizer, lr)
            features, labels = source(batch)
            logits = heads(features)
            # the heads are independent, so the sum's gradient is every head's own gradient
            loss = sum(F.cross_entropy(logits[name], labels) for name in source.names)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter.update(loss.detach() / len(source.names), num_images=labels.shape[0])
            iteration += 1
            if meter.should_log(iteration):
                meter.log(iteration, epoch, opt_cfg.num_epochs, lr)
    return iteration


@torch.no_grad()
def evaluate(source: FrozenFeatures, heads: nn.Module, loader) -> Dict[str, dict]:
    """Collective: top-1/top-5 of every head over ``loader``'s data set, each image counted once.

    Returns ``{name: {"top1": %, "top5": %, "num_images": int}}``, equal on all ranks.
    """
    heads.eval()
    set_epoch(loader, 0)
    names = source.names
    hits = [torch.zeros(0, len(names), 2, dtype=torch.bool, device=source.device)]
    indices = [torch.zeros(0, dtype=torch.long, device=source.device)]
    for batch in loader:
        features, labels = source(batch)
        logits = heads(features)
        hits.append(torch.stack([common.topk_correct(logits[n], labels) for n in names], dim=1))  # (B, F, 2)
        indices.append(batch["index"].to(source.device))
    hits, indices = torch.cat(hits), torch.cat(indices)
    keep = common.unique_on_this_rank(indices)
    counts = torch.zeros(len(names), 3, dtype=torch.float64, device=source.device)
    counts[:, :2] = hits[keep].sum(dim=0).to(torch.float64)
    counts[:, 2] = keep.sum()
    return common.summarise(comm.all_reduce_sum(counts), names)


def _report(run_dir: str, record: dict, writer) -> None:
    """Log table, TensorBoard scalars (rank 0's ``writer``) and metrics.json."""
    weights = record["weights"] or "random init"
    common.log_accuracy_table(f"linear evaluation on DATA.TEST ({weights}):", record["results"])
    if writer is not None:
        for name, res in record["results"].items():
            for metric in ("top1", "top5"):
                writer.add_scalar(f"linear_eval/{name}/{metric}", res[metric], record["iterations"])
        writer.flush()
    logger.info(f"wrote {common.write_metrics(run_dir, record)}")


# --------------------------------------------------------------------------------------------
# checks and config


def _heads_model_config(cfg):
    """MODEL section for the heads: always DDP (they are tiny), sync BN as configured."""
    model_cfg = cfg.MODEL.clone()
    model_cfg.defrost()
    model_cfg.FSDP_CONFIG.AUTO_SETUP_FSDP = False
    model_cfg.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING = False
    model_cfg.freeze()
    return model_cfg
