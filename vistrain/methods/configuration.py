"""A run's config with the methods' keys: every key (``vistrain/config/defaults.py`` plus each
method's LOSS.<name> section and its head's MODEL.HEAD keys), typo-proof and type-checked like any
other, and the methods' rules and checks beside the config layer's.

The config layer is the lowest and cannot import the methods (nor torch, which they need); it takes
their keys as an argument instead (``methods=`` of ``vistrain.config.load_config``). So this is
where a run's config comes from: ``load_config(argv)``, ``get_defaults()``, ``check_config(cfg,
catalog)``.
"""

from typing import Callable, Sequence, Tuple, Union

from fvcore.common.config import CfgNode

from vistrain.config import checks as config_checks
from vistrain.config import defaults as config_defaults
from vistrain.config import loader as config_loader
from vistrain.config.checks import Catalog, Problem
from vistrain.config.warmups import Warmup
from vistrain.methods.registry import DEFAULT_METHOD, HEADS, METHODS


def method_keys() -> CfgNode:
    """What the methods add to the defaults: LOSS.NAME's default and every method's section
    LOSS.<name>; MODEL.HEAD.NAME's default (the default method's head) and every head's keys.
    ValueError for two heads that give one key different defaults."""
    keys = CfgNode()
    keys.LOSS = CfgNode()
    keys.LOSS.NAME = DEFAULT_METHOD
    for name, method in METHODS.items():
        keys.LOSS[name] = method.section()
    keys.MODEL = CfgNode()
    keys.MODEL.HEAD = CfgNode()
    keys.MODEL.HEAD.NAME = METHODS[DEFAULT_METHOD].head.name
    for head in HEADS.values():
        for key, value in head.keys().items():
            if keys.MODEL.HEAD.get(key, value) != value:
                raise ValueError(f"MODEL.HEAD.{key}: the {head.name} head and another give it two defaults")
            keys.MODEL.HEAD[key] = value
    return keys


def get_defaults() -> CfgNode:
    """A fresh, mutable copy of every key of a run with its default."""
    return config_defaults.get_defaults(method_keys())


def load_config(argv: Sequence[str]) -> CfgNode:
    """``vistrain.config.load_config`` with the methods' keys: a run's config (frozen)."""
    return config_loader.load_config(argv, method_keys())


def check_config(cfg: CfgNode, catalog: Union[Catalog, Callable[[], Catalog]], files: bool = True) -> None:
    """``vistrain.config.checks.check_config`` with every method's rules and the run's method's
    checks (:func:`method_problem`); ConfigError (one line) for the first bad value.
    ``files=False``: not the rules that read the file system (the planner's check)."""
    config_checks.check_config(cfg, catalog, method_rules(), (_method_fits,), files=files)


def method_warmups(cfg: CfgNode) -> Tuple[Warmup, ...]:
    """The run's method's warm-ups (``Method.warmups``) by their dotted keys, ``LOSS.<name>.<key>``;
    none for a name the registry does not hold."""
    method = METHODS.get(cfg.LOSS.NAME)
    if method is None:
        return ()
    return tuple(warmup._replace(key=f"LOSS.{method.name}.{warmup.key}") for warmup in method.warmups)


def method_rules() -> config_checks.Rules:
    """Every method's rules, by dotted key (``LOSS.<name>.<key>``)."""
    return {
        f"LOSS.{name}.{key}": rules for name, method in METHODS.items() for key, rules in method.rules.items()
    }


def method_problem(cfg: CfgNode) -> Problem:
    """What keeps LOSS.NAME's method from training with this config, in one line: a head it does
    not read, crops per image it does not take, then its own checks. None for names the
    registries do not hold: their rules name the valid ones."""
    method = METHODS.get(cfg.LOSS.NAME)
    if method is None or cfg.MODEL.HEAD.NAME not in HEADS:
        return None
    if method.head.name != cfg.MODEL.HEAD.NAME:
        return (
            f"LOSS.NAME={cfg.LOSS.NAME} reads a {method.head.name} head: set "
            f"MODEL.HEAD.NAME={method.head.name} (now {cfg.MODEL.HEAD.NAME})"
        )
    problem = _crops_problem(cfg, method.min_crops, method.max_crops)
    for check in method.checks:
        problem = problem or check(cfg)
    return problem


def _crops_problem(cfg: CfgNode, least: int, most) -> Problem:
    """The crops per image DATA.TRAIN makes must be ones the method takes."""
    transforms = cfg.DATA.TRAIN.TRANSFORMS
    if transforms.NAME != "multicrop":
        return None
    crops = sum(transforms.NUM_CROPS)
    if least <= crops and (most is None or crops <= most):
        return None
    wanted = {None: f"{least} or more", least: f"exactly {least}"}.get(most, f"{least} to {most}")
    return (
        f"LOSS.NAME={cfg.LOSS.NAME} takes {wanted} crops per image, but DATA.TRAIN.TRANSFORMS.NUM_CROPS="
        f"{list(transforms.NUM_CROPS)} makes {crops}: change NUM_CROPS (and SIZE_CROPS, CROP_SCALES)"
    )


def _method_fits(cfg: CfgNode, _: Catalog) -> Problem:
    return method_problem(cfg) if cfg.JOB == "train" else None
