"""MoCo v3, Barlow Twins, VICReg and LeJEPA as methods: each criterion calls its loss on the right
crops (the losses themselves: tests/test_joint_embedding_losses.py), its head and its one-line
config errors, what the planner counts for it, and its demo recipe on 2 gloo ranks sharded and
under DDP (the same first 3 losses, fp32, 1e-5), resumed from 2 ranks on 3. SimSiam, NNCLR (with
its support set) and the supervised method too (their own tests: tests/test_new_methods.py), SimMIM
and I-JEPA (tests/test_mim_methods.py)."""

import re
import shutil

import pytest
import torch
import torch.distributed as dist
from test_shipped_configs import losses, shrunk
from torch import nn

from vistrain.checkpoint import consolidated_state_dict
from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses.barlow_twins import barlow_twins_loss
from vistrain.losses.lejepa import lejepa_loss
from vistrain.losses.moco import symmetric_moco_v3_loss
from vistrain.losses.vicreg import vicreg_loss
from vistrain.methods import METHODS, build_method, build_model, check_config, load_config
from vistrain.methods.lejepa import LeJEPACriterion
from vistrain.planner.memory import plan
from vistrain.planner.shape import MIB, ModelShapes, run_shape
from vistrain.planner.traffic import step_collectives
from vistrain.training.resume import resume
from vistrain.training.trainer import _build, train

TINY = {
    "moco_v3_loss": "test/mocov3_tiny",
    "barlow_twins_loss": "test/barlow_twins_tiny",
    "vicreg_loss": "test/vicreg_tiny",
    "lejepa_loss": "test/lejepa_tiny",
    "simsiam_loss": "test/simsiam_tiny",
    "nnclr_loss": "test/nnclr_tiny",
    "supervised_loss": "test/supervised_tiny",
    "simmim_loss": "test/simmim_tiny",
    "ijepa_loss": "test/ijepa_tiny",
    "msn_loss": "test/msn_tiny",
}
TEACHERS = ("moco_v3_loss", "ijepa_loss", "msn_loss")  # the methods with a momentum teacher
DEMOS = [
    "pretrain/mocov3_regnet_demo",
    "pretrain/mocov3_vit_demo",
    "pretrain/barlow_twins_regnet_demo",
    "pretrain/vicreg_regnet_demo",
    "pretrain/lejepa_regnet_demo",
    "pretrain/simsiam_regnet_demo",
    "pretrain/nnclr_regnet_demo",
    "pretrain/supervised_regnet_demo",
    "pretrain/simmim_vit_demo",
    "pretrain/ijepa_vit_demo",
    "pretrain/msn_vit_demo",
]
# simclr_vit_tiny's trunk
_VIT_TRUNK = [
    "config.MODEL.TRUNK.NAME=vit",
    "config.MODEL.TRUNK.VIT.NAME=custom",
    "config.MODEL.TRUNK.VIT.DEPTH=2",
    "config.MODEL.TRUNK.VIT.WIDTH=16",
    "config.MODEL.TRUNK.VIT.HEADS=2",
    "config.MODEL.TRUNK.VIT.PATCH_SIZE=4",
    "config.MODEL.TRUNK.VIT.IMAGE_SIZE=16",
]


def _criterion(name, *overrides):
    return build_method(load_config([f"config={TINY[name]}", *overrides]))


# --------------------------------------------------------------------------------------------
# the criteria


def test_each_criterion_calls_its_loss_on_its_crops():
    torch.manual_seed(0)
    n, d = 6, 5
    z = torch.randn(2 * n, d)
    q, k = torch.randn(2 * n, d), torch.randn(2 * n, d)
    moco = _criterion("moco_v3_loss")
    assert moco.teacher_momentum == 0.9 and moco.teacher_crops([1, 2]) == [1, 2]
    torch.testing.assert_close(
        moco((torch.randn(2 * n, d), q), 2, (k, torch.randn(2 * n, d))),
        symmetric_moco_v3_loss(q.chunk(2), k.chunk(2), 0.5),
        rtol=0, atol=0,
    )  # fmt: skip
    barlow = _criterion("barlow_twins_loss", "config.LOSS.barlow_twins_loss.off_diagonal_weight=0.1")
    torch.testing.assert_close(barlow(z, 2), barlow_twins_loss(z[:n], z[n:], 0.1), rtol=0, atol=0)
    vicreg = _criterion("vicreg_loss", "config.LOSS.vicreg_loss.covariance_weight=3")
    torch.testing.assert_close(vicreg(z, 2), vicreg_loss(z[:n], z[n:], 25, 25, 3), rtol=0, atol=0)
    for criterion in (barlow, vicreg):
        assert criterion.teacher_momentum is None


def test_lejepa_splits_global_and_local_crops_and_draws_directions_from_the_iteration_and_seed():
    torch.manual_seed(0)
    n, d = 5, 4
    views = torch.randn(4, n, d)
    lejepa = _criterion("lejepa_loss", "config.LOSS.lejepa_loss.num_global_crops=1")
    assert lejepa(views.reshape(4 * n, d), 4) == lejepa_loss(
        views[:1], views[1:], step=0, seed=0, num_slices=64
    )
    lejepa.set_iteration(3, 7)
    got = lejepa(views.reshape(4 * n, d), 4)
    assert got == lejepa_loss(views[:1], views[1:], step=3, seed=7, num_slices=64)
    assert got != lejepa_loss(views[:1], views[1:], step=4, seed=7, num_slices=64)
    assert got != lejepa_loss(views[:1], views[1:], step=3, seed=8, num_slices=64)
    every_crop_global = _criterion("lejepa_loss", "config.LOSS.lejepa_loss.num_global_crops=4")
    assert every_crop_global(views.reshape(4 * n, d), 4) == lejepa_loss(views, None, step=0, num_slices=64)


@pytest.mark.parametrize(
    "name, output, crops, teacher, message",
    [
        ("moco_v3_loss", (torch.zeros(12, 4), torch.zeros(12, 4)), 3, None, "exactly 2 crops per image, got 3"),
        ("moco_v3_loss", (torch.zeros(12, 4), torch.zeros(12, 4)), 2, None, "needs the teacher's output"),
        ("barlow_twins_loss", torch.zeros(12, 4), 4, None, "exactly 2 crops per image, got 4"),
        ("barlow_twins_loss", (torch.zeros(12, 4),), 2, None, "a barlow_twins head"),
        ("vicreg_loss", torch.zeros(11, 4), 2, None, "a vicreg head"),
        ("lejepa_loss", torch.zeros(12, 4), 1, None, "the 2 global crops and at least 2 crops, got 1"),
        ("lejepa_loss", torch.zeros(13, 4), 3, None, r"a \(3N, D\) embedding tensor from a lejepa head"),
    ],
)  # fmt: skip
def test_a_criterion_refuses_what_its_head_does_not_make(name, output, crops, teacher, message):
    with pytest.raises(ValueError, match=message):
        _criterion(name)(output, crops, teacher)


def test_the_moco_v3_head_is_the_authors_on_a_resnet_and_on_a_vit():
    """moco-v3's builder.py: BatchNorm after every layer (the output layers' without affine), but
    MoCo_ResNet's predictor ends in a plain Linear (no BN, no bias); MoCo_ViT's keeps the BN."""
    model = build_model(load_config(["config=test/mocov3_tiny"]).MODEL)
    norms = [m for m in model.head.modules() if isinstance(m, nn.BatchNorm1d)]
    # projector [16, 32, 16]: hidden BN, then the output's without affine; predictor: hidden BN only
    assert [(m.num_features, m.affine) for m in norms] == [(32, True), (16, False), (32, True)]
    last = model.head.predictor.layers[-1]
    assert isinstance(last, nn.Linear) and last.bias is None
    k, q = model([torch.randn(3, 3, 16, 16), torch.randn(3, 3, 16, 16)])
    assert k.shape == q.shape == (6, 16)
    vit = load_config(["config=test/mocov3_tiny", *_VIT_TRUNK])
    norms = [m for m in build_model(vit.MODEL).head.modules() if isinstance(m, nn.BatchNorm1d)]
    assert [(m.num_features, m.affine) for m in norms] == [(32, True), (16, False)] * 2
    with pytest.raises(
        ConfigError, match=re.escape("PREDICTOR_DIMS[0] must equal MODEL.HEAD.DIMS[-1] (16), got 8")
    ):
        build_model(load_config(["config=test/mocov3_tiny", "config.MODEL.HEAD.PREDICTOR_DIMS=[8,16]"]).MODEL)


def test_a_head_reads_the_class_token_with_input_feature_cls():
    """MODEL.HEAD.INPUT_FEATURE: the feature a head on one vector per image reads (the authors of
    DINO and MoCo v3: a ViT's class token); one line for a feature it cannot read."""
    vit = ["config=test/mocov3_tiny", *_VIT_TRUNK, "config.MODEL.TRUNK.OUT_FEATURES=[cls,avgpool]"]
    model = build_model(load_config([*vit, "config.MODEL.HEAD.INPUT_FEATURE=cls"]).MODEL)
    x = torch.randn(4, 3, 16, 16)
    k, _ = model(x)
    torch.testing.assert_close(k, model.head(model.trunk(x)["cls"])[0])
    assert not torch.allclose(k, model.head(model.trunk(x)["avgpool"])[0])
    problems = {
        "cls": ("[avgpool]", "reads trunk feature 'cls': add it to MODEL.TRUNK.OUT_FEATURES"),
        "tokens": ("[tokens]", "INPUT_FEATURE=tokens is not one of the trunk's vector features"),
    }
    for feature, (out, message) in problems.items():
        wrong = [f"config.MODEL.TRUNK.OUT_FEATURES={out}", f"config.MODEL.HEAD.INPUT_FEATURE={feature}"]
        with pytest.raises(ConfigError, match=re.escape(message)):
            build_model(load_config([*vit, *wrong]).MODEL)
    dinov2 = ["config=test/dinov2_tiny", "config.MODEL.HEAD.INPUT_FEATURE=cls"]
    with pytest.raises(ConfigError, match=re.escape("the dino head reads the trunk's 'sequence'")):
        build_model(load_config(dinov2).MODEL)


@pytest.mark.parametrize(
    "recipe, overrides, line",
    [
        ("test/mocov3_tiny", ["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2,2]"],
         "LOSS.NAME=moco_v3_loss takes exactly 2 crops per image"),
        ("test/barlow_twins_tiny", ["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[3]"],
         "LOSS.NAME=barlow_twins_loss takes exactly 2 crops per image"),
        ("test/vicreg_tiny", ["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[1]"],
         "LOSS.NAME=vicreg_loss takes exactly 2 crops per image"),
        ("test/lejepa_tiny", ["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[1]"],
         "LOSS.NAME=lejepa_loss takes 2 or more crops per image"),
        ("test/lejepa_tiny", ["config.LOSS.lejepa_loss.num_global_crops=5"],
         "LOSS.lejepa_loss.num_global_crops=5, but DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2, 2] makes 4 crops"),
        ("test/mocov3_tiny", ["config.MODEL.HEAD.NAME=byol"],
         "LOSS.NAME=moco_v3_loss reads a moco_v3 head: set MODEL.HEAD.NAME=moco_v3 (now byol)"),
        ("test/byol_tiny", ["config.MODEL.HEAD.NAME=moco_v3"],
         "LOSS.NAME=byol_loss reads a byol head: set MODEL.HEAD.NAME=byol (now moco_v3)"),
    ],
)  # fmt: skip
def test_a_config_the_method_cannot_train_is_one_line(recipe, overrides, line):
    with pytest.raises(ConfigError, match=re.escape(line)) as error:
        build_method(load_config([f"config={recipe}", *overrides]))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "override, line",
    [
        ("config.LOSS.moco_v3_loss.temperature=0", "LOSS.moco_v3_loss.temperature must be > 0; got 0.0"),
        ("config.LOSS.moco_v3_loss.momentum_teacher=1.5", "LOSS.moco_v3_loss.momentum_teacher is a probability"),
        ("config.LOSS.barlow_twins_loss.off_diagonal_weight=-1", "off_diagonal_weight must be >= 0; got -1.0"),
        ("config.LOSS.vicreg_loss.variance_weight=-1", "LOSS.vicreg_loss.variance_weight must be >= 0"),
        ("config.LOSS.lejepa_loss.sigreg_weight=1.5", "LOSS.lejepa_loss.sigreg_weight is a probability"),
        ("config.LOSS.lejepa_loss.num_global_crops=0", "LOSS.lejepa_loss.num_global_crops must be >= 1"),
        ("config.LOSS.lejepa_loss.num_slices=0", "LOSS.lejepa_loss.num_slices must be > 0; got 0"),
    ],
)  # fmt: skip
def test_a_bad_value_of_a_methods_key_is_one_line(override, line):
    with pytest.raises(ConfigError, match=re.escape(line)):
        check_config(load_config(["config=test/simclr_tiny", override]), lambda: None)


# --------------------------------------------------------------------------------------------
# the planner


def test_the_planner_counts_the_teacher_the_losss_collectives_and_its_memory():
    """MoCo v3 gathers the teacher's keys of each view; Barlow Twins and VICReg gather both views
    and all-reduce their gradient; LeJEPA sums its statistics over the ranks once; NNCLR gathers
    both views for each NT-Xent term and its support set's rows; SimSiam and the supervised loss
    run none."""
    found = {}
    for name, recipe in TINY.items():
        cfg = load_config([f"config={recipe}", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"])
        shape = run_shape(cfg, ModelShapes(cfg.MODEL, 100.0))
        found[name] = sorted((c.op, c.nbytes, c.calls) for c in step_collectives(shape) if c.what == "loss")
        planned = plan(shape)
        assert planned.teacher_params == (planned.params if name in TEACHERS else 0) and planned.params > 0
    view = 2 * 4 * 16 * 4  # ranks x images per rank x width x fp32
    wide = 2 * 4 * 32 * 4
    sums = 2 * (2 * 4 * 64 * 17 + 1) * 4
    # MSN's me-max: ranks x 8 prototypes x fp32; Sinkhorn-Knopp: its max, mass and count, 3 x its row sums
    sinkhorn = [
        ("all_reduce", 4, 1),
        ("all_reduce", 8, 1),
        ("all_reduce", 8 * 4, 3),
    ]  # ranks x (cos and sin x 4 views x 64 slices x 17 knots + 1)
    assert found == {
        "moco_v3_loss": [("all_gather", view, 2)],
        "barlow_twins_loss": [("all_gather", wide, 2), ("all_reduce", wide, 2)],
        "vicreg_loss": [("all_gather", wide, 2), ("all_reduce", wide, 2)],
        "lejepa_loss": [("all_gather", sums, 1), ("all_reduce", sums, 1)],
        "simsiam_loss": [],
        "nnclr_loss": [("all_gather", view, 1), ("all_gather", 2 * view, 2), ("all_reduce", 2 * view, 2)],
        "supervised_loss": [],
        "simmim_loss": [],
        "ijepa_loss": [],
        "msn_loss": sorted([("all_gather", 2 * 8 * 4, 1), ("all_reduce", 2 * 8 * 4, 1), *sinkhorn]),
    }
    nnclr = load_config(["config=pretrain/nnclr_regnet_demo"])  # the support set and a lookup's similarities
    assert METHODS["nnclr_loss"].loss_memory(nnclr) == (64 + 64) * 1024 * 4
    demo = load_config(["config=pretrain/lejepa_regnet_demo"])
    assert METHODS["lejepa_loss"].loss_memory(demo) / MIB == pytest.approx(6.5 * 4 * 64 * 1024 * 17 * 4 / MIB)
    fewer = load_config(["config=pretrain/lejepa_regnet_demo", "config.LOSS.lejepa_loss.num_slices=256"])
    shapes = ModelShapes(demo.MODEL, 100.0)
    saved = plan(run_shape(demo, shapes)).activations - plan(run_shape(fewer, shapes)).activations
    assert saved == METHODS["lejepa_loss"].loss_memory(demo) * 3 / 4


# --------------------------------------------------------------------------------------------
# the demos on 2 ranks: sharded and DDP


def _train_each(rank, world, argvs):
    for argv in argvs:
        train(load_config(argv))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", DEMOS)
def test_demo_sharded_equals_ddp(name, tmp_path, cache_dir):
    """The first 3 losses (fp32, 2 ranks) under AUTO_SETUP_FSDP and under DDP (with MoCo v3 a
    plain teacher copy): the same to 1e-5; both runs write their config and a checkpoint."""
    sharded = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False"]
    ddp = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"]
    runs = [
        shrunk(name, tmp_path / "sharded", cache_dir, *sharded),
        shrunk(name, tmp_path / "ddp", cache_dir, *ddp),
    ]
    run_on_ranks(_train_each, 2, runs)
    for run in ("sharded", "ddp"):
        assert len(losses(tmp_path / run)) == 3 and (tmp_path / run / "config.yaml").exists()
        assert (tmp_path / run / "checkpoint_3").is_dir()
    torch.testing.assert_close(losses(tmp_path / "sharded"), losses(tmp_path / "ddp"), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------
# resume: the same world size, and 2 ranks on 3


def _tiny(name, run_dir, *overrides):
    return [
        f"config={TINY[name]}",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True",
        "config.LOG_FREQUENCY=1",
        "config.CHECKPOINT.KEEP_LAST=10",
        *overrides,
    ]


def _full_then_resumed(rank, world, root):
    """LeJEPA trained 2 epochs, then again from the first epoch's checkpoint in another folder;
    the (iteration, seed) the trainer hands the criterion before each step of each run."""
    calls = []
    original = LeJEPACriterion.set_iteration

    def recorded(criterion, iteration, seed):
        calls.append((iteration, seed))
        original(criterion, iteration, seed)

    LeJEPACriterion.set_iteration = recorded  # this rank's process only
    train(load_config(_tiny("lejepa_loss", root / "full", "config.SEED_VALUE=3")))
    if rank == 0:
        shutil.copytree(root / "full" / "checkpoint_4", root / "resumed" / "checkpoint_4")
    dist.barrier()
    full, calls[:] = list(calls), []
    train(load_config(_tiny("lejepa_loss", root / "resumed", "config.SEED_VALUE=3")))
    return full, calls


def test_lejepa_resumed_draws_the_uninterrupted_runs_directions(tmp_path):
    """The trainer hands LeJEPA the iteration and the run's seed before every step, so a resumed
    run draws the same directions: its losses and final weights equal the uninterrupted run's."""
    for full, resumed in run_on_ranks(_full_then_resumed, 2, tmp_path):
        assert full == [(i, 3) for i in range(8)] and resumed == [(i, 3) for i in range(4, 8)]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "full")[4:]
    full, resumed = (
        consolidated_state_dict(str(tmp_path / run / "checkpoint_8")) for run in ("full", "resumed")
    )
    assert full.keys() == resumed.keys()
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=0, msg=key)


def _resume_on_three(rank, world, argvs):
    """Each run's state right after resuming on this world size."""
    states = []
    for argv in argvs:
        cfg = load_config(argv)
        run = _build(cfg, torch.device("cpu"))
        iteration, _ = resume(cfg.CHECKPOINT.DIR, run)
        student = run.model.state_dict()  # collective: the full weights
        teacher = run.teacher.model.state_dict() if run.teacher is not None else {}
        dist.barrier()
        states.append((iteration, student, teacher, run.criterion.state_dict()))
    return states


def test_every_method_resumes_from_two_ranks_on_three(tmp_path):
    """2 ranks train an epoch; 3 ranks load its checkpoint (the student, MoCo v3's teacher with
    its BatchNorm statistics, NNCLR's support set) as saved."""
    names = list(TINY)
    run_on_ranks(_train_each, 2, [_tiny(n, tmp_path / n, "config.OPTIMIZER.num_epochs=1") for n in names])
    for name in names:
        shutil.copytree(tmp_path / name / "checkpoint_4", tmp_path / "three" / name / "checkpoint_4")
    results = run_on_ranks(_resume_on_three, 3, [_tiny(n, tmp_path / "three" / n) for n in names])
    for i, name in enumerate(names):
        saved = consolidated_state_dict(str(tmp_path / name / "checkpoint_4"))
        saved_loss = torch.load(tmp_path / name / "checkpoint_4" / "rank1.pt", weights_only=True)["extra"][
            "loss"
        ]
        for iteration, student, teacher, loss_state in (rank[i] for rank in results):
            if name == "nnclr_loss":  # every rank's support set is the global one, filled and wrapped
                assert int(loss_state["support.position"]) == 4 * 8 % 12
                for key in ("support.queue", "support.position"):
                    torch.testing.assert_close(loss_state[key], saved_loss[key], rtol=0, atol=0)
            assert iteration > 0 and bool(teacher) == (name in TEACHERS)
            for key, value in student.items():
                torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
            for key, value in teacher.items():
                torch.testing.assert_close(value, saved[f"teacher.{key}"], rtol=0, atol=0, msg=key)
