"""The method layer (vistrain/methods/): one record per method, its keys in the config like any
other key, its checks before the ranks start, and no method named anywhere else in the code."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from fvcore.common.config import CfgNode

import vistrain
from vistrain import cli
from vistrain import config as config_layer
from vistrain.config import ConfigError
from vistrain.config.checks import above
from vistrain.methods import (
    HEADS,
    METHODS,
    Criterion,
    Head,
    LossCollective,
    Method,
    build_method,
    build_model,
    check_config,
    fp32_units,
    get_defaults,
    load_config,
    method_keys,
)
from vistrain.methods.dino import DINOLastLayer
from vistrain.methods.msn import MSNPrototypes
from vistrain.methods.swav import SwAVPrototypes
from vistrain.models.heads import MLP
from vistrain.planner.shape import ModelShapes, run_shape
from vistrain.planner.traffic import step_collectives

ROOT = pathlib.Path(vistrain.__file__).parent
REPO = ROOT.parent
METHOD_NAMES = re.compile(
    r"simclr|swav|dino|byol|moco|barlow|vicreg|lejepa|simsiam|nnclr|(?<![a-z])msn", re.IGNORECASE
)
# where methods may be named: their own files, and the pure loss math they call
METHOD_PACKAGES = {"methods", "losses"}


# --------------------------------------------------------------------------------------------
# nothing outside the method layer names a method


def _docstrings(tree: ast.AST) -> set:
    """ids of the docstring constants of a module and its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _words(node: ast.AST):
    """The identifiers a node defines or uses, and its string (or f-string part) constant."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg:
        yield node.arg
    elif isinstance(node, ast.alias):
        yield node.name
        yield node.asname or ""
    elif isinstance(node, ast.ImportFrom):
        yield node.module or ""
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value


def method_names_in(source: str) -> list:
    """(line, word) of every method name in the code of ``source`` (comments and docstrings are
    not code)."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return [
        (node.lineno, word)
        for node in ast.walk(tree)
        if id(node) not in docstrings
        for word in _words(node)
        if METHOD_NAMES.search(word)
    ]


def test_no_code_outside_the_method_layer_names_a_method():
    """The trainer, the planner, the checkpoint, runtime, models and config code (every package
    but the methods and their loss math) ask the method records instead."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in METHOD_PACKAGES or "configs" in relative.parts:
            continue
        found += [f"{relative}:{line}: {word!r}" for line, word in method_names_in(path.read_text())]
    assert found == []


def test_the_name_finder_reads_code_not_prose():
    source = (
        '"""SwAV in a docstring."""\n'
        "# DINO in a comment\n"
        "def f(x):\n"
        '    """BYOL here too."""\n'
        '    return x.LOSS.swav_loss, f"{x}_Dino", byol_head(simclr=1)\n'
    )
    assert [word for _, word in method_names_in(source)] == ["swav_loss", "_Dino", "byol_head", "simclr"]


# --------------------------------------------------------------------------------------------
# the registries


def test_the_registries_agree():
    assert all(name == method.name for name, method in METHODS.items())
    assert all(name == head.name for name, head in HEADS.items())
    for method in METHODS.values():
        assert HEADS[method.head.name] is method.head  # one record per head name
        assert issubclass(method.criterion, Criterion)
        section = method.section()
        assert set(method.rules) <= set(section), method.name
        assert method.min_crops >= 1 and (method.max_crops is None or method.max_crops >= method.min_crops)
    assert fp32_units(get_defaults().MODEL) == ()


@pytest.mark.parametrize(
    "name",
    [
        "test/simclr_tiny",
        "test/swav_tiny",
        "test/dino_tiny",
        "test/byol_tiny",
        "test/mocov3_tiny",
        "test/barlow_twins_tiny",
        "test/vicreg_tiny",
        "test/lejepa_tiny",
        "test/simsiam_tiny",
        "test/nnclr_tiny",
        "test/supervised_tiny",
        "test/msn_tiny",
    ],
)
def test_a_method_record_says_what_its_criterion_does(name):
    cfg = load_config([f"config={name}"])
    method, criterion = METHODS[cfg.LOSS.NAME], build_method(cfg)
    assert isinstance(criterion, method.criterion)
    assert (criterion.teacher_momentum is not None) == method.teacher
    units = {
        "test/swav_tiny": (SwAVPrototypes,),
        "test/dino_tiny": (DINOLastLayer,),
        "test/msn_tiny": (MSNPrototypes,),
    }.get(name, ())
    assert fp32_units(cfg.MODEL) == units
    assert all(any(isinstance(m, unit) for m in build_model(cfg.MODEL).modules()) for unit in units)


def test_the_planner_counts_the_losss_own_collectives():
    """SimCLR gathers the embeddings, SwAV all-reduces in Sinkhorn, DINO all-reduces its centre
    (K floats), BYOL's loss runs none."""

    def loss_bytes(name, *overrides):
        cfg = load_config([f"config={name}", *overrides])
        found = [
            c for c in step_collectives(run_shape(cfg, ModelShapes(cfg.MODEL, 100.0))) if c.what == "loss"
        ]
        return sorted((c.op, c.nbytes, c.calls) for c in found)

    embeddings = 2 * 2 * 4 * 16 * 4  # ranks x crops x images per rank x width x fp32
    assert loss_bytes("test/simclr_tiny") == [("all_gather", embeddings, 1), ("all_reduce", embeddings, 1)]
    assert loss_bytes("test/dino_tiny") == [("all_reduce", 32 * 4, 1)]
    assert loss_bytes("test/byol_tiny") == []
    assert ("all_reduce", 10 * 4, 2 * 3) in loss_bytes("test/swav_tiny")


# --------------------------------------------------------------------------------------------
# the methods' keys in the config


def test_every_method_key_is_in_a_runs_defaults():
    defaults = get_defaults()
    assert defaults.LOSS.NAME in METHODS and METHODS[defaults.LOSS.NAME].head.name == defaults.MODEL.HEAD.NAME
    for name, method in METHODS.items():
        assert defaults.LOSS[name] == method.section()
        for key, value in method.head.keys().items():
            assert defaults.MODEL.HEAD[key] == value


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "config.LOSS.dino_loss.teacher_tmp=0.05",
            "unknown config key LOSS.dino_loss.teacher_tmp; did you mean LOSS.dino_loss.teacher_temp?",
        ),
        (
            "config.LOSS.swav_loss.queue_length=1.5",
            "config key LOSS.swav_loss.queue_length expects int, got '1.5'",
        ),
        ("config.MODEL.HEAD.OUT_DIM=wide", "config key MODEL.HEAD.OUT_DIM expects int, got 'wide'"),
        (
            "config.MODEL.HEAD.PREDICTOR_DIM=[8]",
            "unknown config key MODEL.HEAD.PREDICTOR_DIM; did you mean MODEL.HEAD.PREDICTOR_DIMS?",
        ),
    ],
)
def test_method_keys_are_typo_and_type_checked(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(["config=test/simclr_tiny", override])


def test_the_config_layer_alone_holds_the_method_sections_open():
    """What the command line reads before torch: the methods' keys as given, nothing more."""
    cfg = config_layer.load_config(["config=test/dino_tiny", "config.LOSS.dino_loss.teacher_tmp=0.05"])
    assert cfg.LOSS.NAME == "dino_loss" and "student_temp" not in cfg.LOSS.dino_loss
    assert cfg.LOSS.dino_loss.teacher_tmp == 0.05  # a typo: found once the methods' keys are known
    assert config_layer.get_defaults().LOSS.NAME == "" and config_layer.get_defaults().LOSS.is_new_allowed()
    assert not get_defaults().LOSS.is_new_allowed() and not get_defaults().MODEL.HEAD.is_new_allowed()
    with pytest.raises(ConfigError, match="unknown config key MODEL.TRUNK.NAM;"):
        config_layer.load_config(["config.MODEL.TRUNK.NAM=vit"])  # other sections stay closed


def test_two_heads_may_not_give_one_key_two_defaults(monkeypatch):
    def keys():
        c = CfgNode()
        c.OUT_DIM = 7
        return c

    monkeypatch.setitem(HEADS, "other", Head("other", MLP, keys))
    with pytest.raises(
        ValueError, match="MODEL.HEAD.OUT_DIM: the other head and another give it two defaults"
    ):
        method_keys()


# --------------------------------------------------------------------------------------------
# a builder's checks, before the ranks start


@pytest.mark.parametrize(
    "recipe, overrides, line",
    [
        (
            "test/simclr_tiny",
            ["config.MODEL.HEAD.NAME=byol"],
            "LOSS.NAME=simclr_loss reads a simclr head: set MODEL.HEAD.NAME=simclr (now byol)",
        ),
        (
            "test/byol_tiny",
            ["config.MODEL.HEAD.PREDICTOR_DIMS=[8,16,8]"],
            "MODEL.HEAD.PREDICTOR_DIMS[0] must equal MODEL.HEAD.DIMS[-1] (16), got 8",
        ),
        (
            "test/swav_tiny",
            ["config.MODEL.HEAD.NMB_PROTOTYPES=[0]"],
            "MODEL.HEAD.NMB_PROTOTYPES needs positive sizes",
        ),
        ("test/dino_tiny", ["config.MODEL.HEAD.OUT_DIM=0"], "MODEL.HEAD.OUT_DIM must be positive, got 0"),
        (
            "test/simclr_tiny",
            ["config.MODEL.HEAD.DIMS=[16]"],
            "MODEL.HEAD.DIMS needs at least two positive sizes",
        ),
        (
            "test/byol_tiny",
            ["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2,2]"],
            "LOSS.NAME=byol_loss takes exactly 2 crops per image",
        ),
        (
            "test/dino_tiny",
            ["config.LOSS.dino_loss.num_global_crops=5"],
            "LOSS.dino_loss.num_global_crops=5, but DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2, 2] makes 4 crops",
        ),
        (
            "test/swav_tiny",
            ["config.LOSS.swav_loss.queue_lenght=3"],
            "unknown config key LOSS.swav_loss.queue_lenght; did you mean LOSS.swav_loss.queue_length?",
        ),
    ],
)
def test_a_builders_check_is_one_line_before_the_ranks_start(recipe, overrides, line, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = cli.main([f"config={recipe}", f"config.CHECKPOINT.DIR={run_dir}", *overrides])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"config error: {line}"), lines
    assert not run_dir.exists()


def test_a_head_the_method_does_not_read_is_one_line_from_the_real_command(tmp_path):
    """The quick start with another method's head: exit 2 and one line, no rank traceback."""
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_distributed.py"), "config=regnet_fsdp"]
        + ["config.MODEL.HEAD.NAME=byol", f"config.CHECKPOINT.DIR={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "config error: LOSS.NAME=simclr_loss reads a simclr head: set MODEL.HEAD.NAME=simclr (now byol)"
    ]
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# a new method: one record, no other file


class ToyCriterion(Criterion):
    """weight * mean(z^2) of the embeddings; a teacher that sees the first crop only."""

    def __init__(self, section, head_cfg=None):
        super().__init__()
        self.weight = section.weight
        self.teacher_momentum = section.momentum

    def teacher_crops(self, crops):
        return crops[:1]

    def forward(self, model_output, num_crops, teacher_output=None):
        return self.weight * model_output.pow(2).mean() + 0 * teacher_output.sum()


def _toy_section():
    c = CfgNode()
    c.weight = 1.0  # the loss's scale
    c.momentum = 0.99  # m0 of the teacher
    return c


def _toy_head_keys():
    c = CfgNode()
    c.TOY_WIDTH = 4  # unused
    return c


TOY_HEAD = Head("toy", lambda head_cfg: MLP(head_cfg.DIMS, head_cfg.USE_BN), _toy_head_keys)
TOY = Method(
    "toy_loss",
    ToyCriterion,
    TOY_HEAD,
    _toy_section,
    rules={"weight": [above(0)]},
    teacher=True,
    max_crops=2,
    collectives=lambda cfg, world: [LossCollective("broadcast", 8, 3)],
)


def test_a_new_method_is_one_record(monkeypatch):
    monkeypatch.setitem(METHODS, "toy_loss", TOY)
    monkeypatch.setitem(HEADS, "toy", TOY_HEAD)
    toy = ["config=test/simclr_tiny", "config.LOSS.NAME=toy_loss", "config.MODEL.HEAD.NAME=toy"]
    cfg = load_config([*toy, "config.LOSS.toy_loss.weight=2"])
    assert cfg.LOSS.toy_loss.weight == 2.0 and cfg.MODEL.HEAD.TOY_WIDTH == 4
    with pytest.raises(ConfigError, match="did you mean LOSS.toy_loss.weight"):
        load_config([*toy, "config.LOSS.toy_loss.wieght=2"])
    with pytest.raises(ConfigError, match=re.escape("LOSS.toy_loss.weight must be > 0; got 0.0")):
        check_config(load_config([*toy, "config.LOSS.toy_loss.weight=0"]), lambda: None)
    with pytest.raises(ConfigError, match="LOSS.NAME=toy_loss takes exactly 2 crops"):
        build_method(load_config([*toy, "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[3]"]))
    criterion, model = build_method(cfg), build_model(cfg.MODEL)
    crops = [torch.randn(2, 3, 16, 16)] * 2
    teacher_output = model(criterion.teacher_crops(crops))
    loss = criterion(model(criterion.student_crops(crops)), 2, teacher_output)
    assert loss.shape == () and criterion.teacher_momentum == 0.99

    from vistrain.planner.memory import plan

    shape = run_shape(cfg, ModelShapes(cfg.MODEL, 100.0))
    planned = plan(shape)
    assert planned.teacher_params == planned.params > 0
    assert [(c.op, c.calls) for c in step_collectives(shape) if c.what == "loss"] == [("broadcast", 3)]
