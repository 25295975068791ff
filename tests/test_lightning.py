"""Trainer(strategy=VistrainFSDPStrategy) against DDPStrategy on real processes (Lightning's own
launcher forking 2 gloo ranks): the same weights, losses and metrics; checkpoints resumed on
other device counts. Each fixture runs its fits once and serves several checks."""

import multiprocessing
import os
import runpy
from datetime import timedelta
from pathlib import Path

import pytest

pl = pytest.importorskip("pytorch_lightning", reason='Lightning bridge: pip install -e ".[lightning]"')

import torch  # noqa: E402
from lightning_models import (  # noqa: E402
    ConvNet,
    Critic,
    MAEClient,
    OwnStorageDDP,
    Recorder,
    Regressor,
    SSLClient,
    checkpoint_path,
    read_has_grad,
    read_losses,
    trainer_kwargs,
)
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.plugins.precision import MixedPrecision  # noqa: E402
from pytorch_lightning.strategies import StrategyRegistry  # noqa: E402

from vistrain.checkpoint import consolidated_state_dict, read_metadata  # noqa: E402
from vistrain.distributed.launch import find_free_port  # noqa: E402
from vistrain.distributed.testing import run_on_ranks  # noqa: E402
from vistrain.integrations.lightning import StrategyError, VistrainFSDPStrategy  # noqa: E402
from vistrain.integrations.lightning.checkpoint import OptimizerSet, weights_only_safe  # noqa: E402
from vistrain.integrations.lightning.engine import build_policy  # noqa: E402
from vistrain.integrations.lightning.precision import ShardedMixedPrecision  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-6  # DDP parity on the same ranks
TOL_DEVICES = 1e-5  # another device count sums each global batch in another order


# a lost rank fails the fit in two minutes instead of hanging for torch's default 30
RENDEZVOUS = timedelta(seconds=120)
# Ranks fork from a server that imported these once and never computed: forked from pytest's own
# process, a rank's first OpenMP region (MKL's tanh) hung on the thread pool earlier tests had
# started there, which does not survive fork (libgomp); "spawn" imports Lightning again per rank.
START_METHOD = "forkserver"
multiprocessing.set_forkserver_preload(["torch", "pytorch_lightning", "lightning_models"])


def ddp(**options):
    return OwnStorageDDP(
        process_group_backend="gloo", start_method=START_METHOD, timeout=RENDEZVOUS, **options
    )


def sharded(**options):
    return VistrainFSDPStrategy(start_method=START_METHOD, timeout=RENDEZVOUS, **options)


def fit(strategy, make_module, devices=2, ckpt_path=None, **kwargs):
    """A fresh Trainer and module (same seed for every strategy); fit; the trained module."""
    pl.seed_everything(0)
    # Lightning keeps the first fit's MASTER_PORT in the environment for every later fit
    os.environ["MASTER_PORT"] = str(find_free_port())
    module = make_module()
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=devices, **kwargs))
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def rel_diff(a, b) -> float:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max(rel_diff(a[k], b[k]) for k in a)
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


AUTOMATIC = dict(max_epochs=2, gradient_clip_val=0.1, accumulate_grad_batches=2)


@pytest.fixture(scope="module")
def automatic(tmp_path_factory):
    """Param groups, a schedule, global-norm clipping, accumulation, validation and test loops,
    ModelCheckpoint: DDP and the sharded strategy, 2 ranks, 2 epochs."""
    out = {}
    for name, strategy, test_strategy in (("ddp", ddp(), ddp()), ("sharded", sharded(), sharded())):
        folder = tmp_path_factory.mktemp(name)
        saver = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1, save_last=True)
        trainer, module = fit(
            strategy,
            Regressor,
            callbacks=[saver, Recorder(str(folder / "losses.json"))],
            enable_checkpointing=True,
            **AUTOMATIC,
        )
        tester = pl.Trainer(**trainer_kwargs(strategy=test_strategy, devices=2))
        out[name] = {
            "state": state(module),
            "losses": read_losses(folder / "losses.json"),
            "has_grad": read_has_grad(folder / "losses.json"),
            "val": trainer.callback_metrics["val_loss"].item(),
            # an untrained module: the test stage loads the last checkpoint (weights only, outside fit)
            "test": tester.test(Regressor(), ckpt_path=folder / "last.ckpt", verbose=False)[0]["test_loss"],
            "folder": folder,
        }
    return out


def test_automatic_optimization_equals_ddp(automatic):
    ddp_run, ours = automatic["ddp"], automatic["sharded"]
    assert len(ours["losses"]) == 8 and rel_diff(ours["losses"], ddp_run["losses"]) < TOL
    assert rel_diff(ours["state"], ddp_run["state"]) < TOL  # every key came back, trained
    assert rel_diff(ours["state"], Regressor().state_dict()) > 1e-2
    assert abs(ours["val"] - ddp_run["val"]) < TOL * abs(ddp_run["val"])
    assert abs(ours["test"] - ddp_run["test"]) < TOL * abs(ddp_run["test"])
    # accumulate_grad_batches=2: the first micro-batch's gradients stay unreduced (no_sync), kept
    # with a (zero) shard.grad that zero_grad() would clear, as DDP keeps its local ones in .grad
    assert ours["has_grad"] == ddp_run["has_grad"] == [True] * 8


def test_model_checkpoint_writes_sharded_folders_that_convert(automatic, tmp_path):
    folder = automatic["sharded"]["folder"]
    for name in ("epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"):
        meta = read_metadata(str(folder / name))
        assert meta["world_size"] == 2 and meta["optimizer"]["class"] == "SGD"
        assert [len(g["params"]) for g in meta["optimizer"]["param_groups"]] == [
            3,
            4,
        ]  # weights; biases + scale
        assert sorted(os.listdir(folder / name)) == ["metadata.json", "rank0.pt", "rank1.pt"]
    out = tmp_path / "model.pt"
    tool = runpy.run_path(str(REPO / "tools" / "convert_checkpoint.py"))  # its main(), in this process
    assert tool["main"]([str(folder / "epoch=0.ckpt"), "--to-consolidated", str(out)]) == 0
    ddp_file = torch.load(automatic["ddp"]["folder"] / "epoch=0.ckpt", weights_only=True)["state_dict"]
    assert rel_diff(torch.load(out, weights_only=True), ddp_file) < TOL
    assert rel_diff(consolidated_state_dict(str(folder / "last.ckpt")), automatic["ddp"]["state"]) < TOL


@pytest.fixture(scope="module")
def resumed(automatic, tmp_path_factory):
    """Resume the 2-rank run's epoch-0 checkpoint on 1 device; a 1-device run's on 3 devices
    (the global batch stays 12)."""
    folder = tmp_path_factory.mktemp("resumed")
    kwargs = dict(AUTOMATIC, callbacks=[Recorder(str(folder / "on1.json"))])
    _, on1 = fit(
        sharded(),
        lambda: Regressor(batch_size=12),
        devices=1,
        ckpt_path=checkpoint_path(automatic["sharded"]["folder"], 0),
        **kwargs,
    )
    saver = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)
    first = dict(AUTOMATIC, max_epochs=1, enable_checkpointing=True)
    fit(
        sharded(),
        lambda: Regressor(batch_size=12),
        1,
        callbacks=[saver, Recorder(str(folder / "first.json"))],
        **first,
    )
    _, on3 = fit(
        sharded(),
        lambda: Regressor(batch_size=4),
        devices=3,
        ckpt_path=checkpoint_path(folder, 0),
        **dict(AUTOMATIC, callbacks=[Recorder(str(folder / "on3.json"))]),
    )
    return {
        "on1": (read_losses(folder / "on1.json"), state(on1)),
        "first": read_losses(folder / "first.json"),
        "on3": (read_losses(folder / "on3.json"), state(on3)),
    }


def test_resume_on_other_device_counts_continues_the_uninterrupted_run(automatic, resumed):
    losses, final = automatic["sharded"]["losses"], automatic["sharded"]["state"]
    for name in ("on1", "on3"):
        after, weights = resumed[name]
        assert len(after) == 4 and rel_diff(after, losses[4:]) < TOL_DEVICES, name
        assert rel_diff(weights, final) < TOL_DEVICES, name
    assert rel_diff(resumed["first"], losses[:4]) < TOL_DEVICES  # 1 device equals 2 ranks


@pytest.fixture(scope="module")
def precisions():
    """bf16 autocast, and fp16 autocast with loss scaling (the plugin given explicitly: the
    Trainer turns "16-mixed" on CPU into bf16); convolutions and BatchNorm, evaluated on rank 0's
    statistics."""
    out = {}
    for precision in ("bf16-mixed", "16-mixed"):
        for name, strategy in (("ddp", ddp()), ("sharded", sharded())):
            kwargs = dict(max_epochs=1, gradient_clip_val=0.1)
            if precision == "16-mixed":
                kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu")]
            else:
                kwargs["precision"] = precision
            trainer, module = fit(strategy, ConvNet, **kwargs)
            metrics = trainer.callback_metrics
            out[precision, name] = (state(module), metrics["train_loss"].item(), metrics["val_loss"].item())
    return out


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_equals_ddp(precisions, precision):
    (ours, loss, val), (reference, ref_loss, ref_val) = (
        precisions[precision, "sharded"],
        precisions[precision, "ddp"],
    )
    assert rel_diff(ours, reference) < TOL and abs(loss - ref_loss) < TOL * abs(ref_loss)
    assert abs(val - ref_val) < TOL * abs(ref_val)


@pytest.fixture(scope="module")
def manual(tmp_path_factory):
    folder = tmp_path_factory.mktemp("manual")
    out = {}
    # the critic's step leaves the encoder unused: DDP must be told; the engine needs no option
    for name, strategy in (("ddp", ddp(find_unused_parameters=True)), ("sharded", sharded())):
        path = str(folder / f"{name}.json")
        _, module = fit(strategy, Critic, max_epochs=2, callbacks=[Recorder(path)])
        out[name] = (state(module), read_losses(path))
    return out


def test_manual_optimization_with_two_optimizers_equals_ddp(manual):
    (ours, losses), (reference, ref_losses) = manual["sharded"], manual["ddp"]
    assert len(losses) == 8 and rel_diff(losses, ref_losses) < TOL and rel_diff(ours, reference) < TOL


@pytest.fixture(scope="module")
def ssl_clients():
    """An SSL client's habits (in-place prototype normalisation, EMA teacher by zip, p.grad =
    None, clipping) under DDP and the sharded strategy; sync_batchnorm=True on 2 CPU ranks (DDP
    refuses it on CPU) and one process on the global batch (the same sampler's order)."""
    runs = {}
    for name, strategy in (("ddp", ddp()), ("sharded", sharded())):
        _, module = fit(strategy, SSLClient, max_epochs=2, gradient_clip_val=0.5)
        runs[name] = state(module)
    _, module = fit(sharded(), SSLClient, max_epochs=2, sync_batchnorm=True)
    runs["synced"] = state(module)
    _, module = fit(sharded(), lambda: SSLClient(batch_size=12), devices=1, max_epochs=2)
    runs["one_process"] = state(module)
    return runs


def test_an_ssl_clients_own_code_equals_ddp(ssl_clients):
    ours, ddp_run = ssl_clients["sharded"], ssl_clients["ddp"]
    assert rel_diff(ours, ddp_run) < TOL_DEVICES  # student, teacher (the EMA) and prototypes
    assert rel_diff(ours, SSLClient().state_dict()) > 1e-2
    rows = ours["prototypes.weight"].norm(dim=1)
    assert (rows - 1).abs().max() < 0.2  # normalised every step, then one step moved them


def test_sync_batchnorm_on_cpu_equals_one_process_on_the_global_batch(ssl_clients):
    synced, single = ssl_clients["synced"], ssl_clients["one_process"]
    assert rel_diff(synced, single) < TOL_DEVICES
    assert rel_diff(synced["student.1.running_mean"], single["student.1.running_mean"]) < TOL_DEVICES


def test_a_masked_client_calling_its_modules_by_name_equals_ddp(tmp_path):
    """lightly's MAE example, unmodified (``backbone.encode``, ``decoder.embed / decode /
    predict``), trains as under DDP (which needs ``find_unused_parameters`` for the backbone's
    unused mask token): the strategy gathers a unit's public methods. With that off, the first
    step stops on one line naming the registration that would do it."""
    runs = {}
    for name, strategy in (("ddp", ddp(find_unused_parameters=True)), ("sharded", sharded())):
        path = str(tmp_path / f"{name}.json")
        _, module = fit(strategy, MAEClient, max_epochs=1, callbacks=[Recorder(path)])
        runs[name] = (state(module), read_losses(path))
    (ours, losses), (reference, ref_losses) = runs["sharded"], runs["ddp"]
    assert len(losses) == 2 and rel_diff(losses, ref_losses) < TOL and rel_diff(ours, reference) < TOL
    assert rel_diff(reference, state(MAEClient())) > 1e-3
    with pytest.raises(
        Exception,
        match='MaskedVisionTransformerTorchvision.encode\\(\\) computed with this rank.s shard.*register_forward_method\\(module, "encode"\\)',
    ):
        fit(sharded(gather_public_methods=False), MAEClient, max_epochs=1)


def test_engine_knobs():
    """The step in backward and ZeRO-2 are exact; the engine's bf16 compute is close."""
    kwargs = dict(max_epochs=1, accumulate_grad_batches=2)
    trainer, reference = fit(ddp(), lambda: Regressor(optimizer="adamw"), **kwargs)
    exact = sharded(step_in_backward=True, reshard_after_forward=False)
    _, ours = fit(exact, lambda: Regressor(optimizer="adamw"), **kwargs)
    assert rel_diff(state(ours), state(reference)) < TOL
    bf16_trainer, bf16 = fit(sharded(mixed_precision=True), lambda: Regressor(optimizer="adamw"), **kwargs)
    val, bf16_val = (t.callback_metrics["val_loss"].item() for t in (trainer, bf16_trainer))
    assert 0 < abs(bf16_val - val) < 1e-2 * val  # bf16 weights and activations; the shards stay fp32
    assert {v.dtype for v in state(bf16).values()} == {torch.float32}


def test_refusals_name_the_setting():
    with pytest.raises(Exception, match="parameters \\['offset'\\] belong to no nested unit"):
        fit(sharded(), lambda: Critic(own_parameter=True), max_epochs=1)
    with pytest.raises(Exception, match="step_in_backward=True cannot be exact with gradient_clip_val"):
        fit(sharded(step_in_backward=True), Regressor, max_epochs=1, gradient_clip_val=1.0)
    with pytest.raises(StrategyError, match="unknown engine option 'prefetch'"):
        VistrainFSDPStrategy(prefetch=2)
    with pytest.raises(StrategyError, match="auto_wrap_policy='Linear'"):
        build_policy("Linear", Regressor())
    with pytest.raises(StrategyError, match="not a vistrain checkpoint folder"):
        VistrainFSDPStrategy().load_checkpoint(REPO / "setup.py")
    with pytest.raises(StrategyError, match=r"checkpoint\['x'\] holds a object"):
        weights_only_safe({"x": object()}, "checkpoint")
    kept = weights_only_safe({"hyper_parameters": {"f": object()}, "t": (1, [2.0])}, "checkpoint")
    assert kept["hyper_parameters"]["f"].startswith("<object") and kept["t"] == (1, [2.0])
    shared = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(StrategyError, match="held by two optimizers"):
        OptimizerSet([torch.optim.SGD([shared], lr=1), torch.optim.SGD([shared], lr=1)])


def test_registered_name_and_sharded_scaler():
    trainer = pl.Trainer(**trainer_kwargs(strategy="vistrain_fsdp", devices=2, precision="bf16-mixed"))
    assert isinstance(trainer.strategy, VistrainFSDPStrategy)
    assert StrategyRegistry["vistrain_fsdp_fork"]["init_params"] == {"start_method": "fork"}
    trainer = pl.Trainer(
        **trainer_kwargs(strategy=sharded(), devices=2, plugins=[MixedPrecision("16-mixed", "cpu")])
    )
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ShardedMixedPrecision) and type(plugin.scaler).__name__ == "ShardedGradScaler"


def _external_launch_worker(rank, world, folder):
    """Processes started outside Lightning (torchrun, SLURM; here the test harness): several
    fits in one process, each stage tearing the engine down again."""
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then creates no processes
    kwargs = dict(max_epochs=1, accumulate_grad_batches=2)
    _, straight = fit(
        VistrainFSDPStrategy(), lambda: Regressor(optimizer="adamw"), **dict(kwargs, max_epochs=2)
    )
    trainer, module = fit(VistrainFSDPStrategy(), lambda: Regressor(optimizer="adamw"), **kwargs)
    optimizer = trainer.optimizers[0]
    plain = {id(p) for p in module.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    state_shapes = all(optimizer.state[p]["exp_avg"].shape == p.shape for p in held)
    trainer.save_checkpoint(os.path.join(folder, "after_fit.ckpt"))  # the plain module and its optimizer
    _, resumed = fit(
        VistrainFSDPStrategy(),
        lambda: Regressor(optimizer="adamw"),
        ckpt_path=os.path.join(folder, "after_fit.ckpt"),
        **dict(kwargs, max_epochs=2),
    )
    return {
        "plain": all(type(p) is torch.nn.Parameter for p in module.parameters()),
        "optimizer_holds_module": {id(p) for p in held} == plain and state_shapes,
        "resumed": rel_diff(state(resumed), state(straight)),
    }


def test_processes_started_outside_lightning_and_the_state_after_fit(tmp_path):
    for out in run_on_ranks(_external_launch_worker, 2, str(tmp_path)):
        assert out["plain"] and out["optimizer_holds_module"], out
        assert out["resumed"] < TOL, out
