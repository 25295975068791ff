"""The allowed values of the config (one table, beside the defaults) and the check run before a job.

``load_config`` checks that keys exist and have the default's type; :func:`check_config` then
checks every value against :data:`RULES` (one entry per key with limits) and
:data:`CROSS_RULES` (limits that involve several keys, the engine, or the file system): names,
dtypes, ranges, data paths that must exist and hold at least one global batch, the run folder
that must be writable, the weights file that must load, a head whose input matches the trunk.
The first problem is a one-line :class:`ConfigError`; nothing is written. The methods' sections
have their rules and checks in their files (``vistrain/methods/``), which
``vistrain.methods.check_config`` passes to :func:`check_config` beside these.

Registry names (optimizers, heads, data sources...) and the probes of files and models live in
higher layers, which this lowest layer must not import (tests/test_layering.py). The table names
them by key (``one_of("optimizers")``) and the caller passes a :class:`Catalog` holding the live
registries: ``vistrain.jobs.catalog()``, the top layer. So each registry stays the one list of its
names, nothing here loads torch, and the launcher checks right after loading, before it locks the
run folder or starts a rank.
"""

import dataclasses
import functools
import importlib.util
import os
import tempfile
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from fvcore.common.config import CfgNode

from vistrain.config.errors import ConfigError, InputError
from vistrain.config.words import plural

# Names the launcher also checks when it is called directly from Python (not through the CLI).
DEVICES = ("auto", "cpu", "cuda")
DIST_BACKENDS = ("auto", "nccl", "gloo")
INIT_METHODS = ("tcp", "env", "file")

Problem = Optional[str]  # a rule's answer: None when the value is fine, else what is wrong with it


@dataclasses.dataclass(frozen=True)
class Catalog:
    """What only the layers above the config know, handed to :func:`check_config`."""

    names: Mapping[str, Sequence[str]]  # registry key ("optimizers", "heads"...) -> valid names
    weights_problem: Callable[[str], Problem]  # WEIGHTS_INIT.PARAMS_FILE -> what keeps it from loading
    trunk_features: Callable[[CfgNode], Sequence[str]]  # MODEL.TRUNK -> its feature names
    # (ValueError for an impossible trunk)
    # the config -> what keeps its MODEL from being built or from taking DATA.TRAIN's crops (on meta)
    model_problem: Callable[[CfgNode], Problem]
    num_samples: Callable[[CfgNode], int]  # DATA.<split> -> its samples (InputError when it has none)
    world_size: Callable[[CfgNode], int]  # the whole config -> ranks of the job it starts or joins


Choices = Union[str, Sequence[str]]  # a registry key of the Catalog, or the names themselves


def _names(choices: Choices, catalog: Catalog) -> Sequence[str]:
    return catalog.names[choices] if isinstance(choices, str) else choices


def one_of(choices: Choices) -> Callable:
    def rule(value, catalog: Catalog) -> Problem:
        valid = _names(choices, catalog)
        return None if value in valid else f"must be one of {', '.join(valid)}; got {value!r}"

    return rule


def each_one_of(choices: Choices) -> Callable:
    """A non-empty list whose every element is a valid name."""

    def rule(value, catalog: Catalog) -> Problem:
        valid = _names(choices, catalog)
        wrong = [v for v in value if v not in valid]
        if not value or wrong:
            return f"must be a non-empty list of {', '.join(valid)}; got {list(value)}"
        return None

    return rule


def at_least(low) -> Callable:
    return lambda value, _: None if value >= low else f"must be >= {low}; got {value}"


def above(low) -> Callable:
    return lambda value, _: None if value > low else f"must be > {low}; got {value}"


def below(high) -> Callable:
    return lambda value, _: None if value < high else f"must be < {high}; got {value}"


def at_most(high) -> Callable:
    return lambda value, _: None if value <= high else f"must be <= {high}; got {value}"


def probability(value, _) -> Problem:
    return None if 0 <= value <= 1 else f"is a probability in [0, 1]; got {value}"


def value_range(value, _) -> Problem:
    """[] or [low, high] with low < high (DATA.<split>.PIXEL_RANGE)."""
    if not value or (len(value) == 2 and value[0] < value[1]):
        return None
    return f"must be [] (the dtype's range) or [low, high] with low < high; got {list(value)}"


def writable_folder(value: str, _) -> Problem:
    """A folder that exists and is writable, or could be created: a folder made (and removed) in
    the nearest existing one says so, where permission bits do not (root on a read-only mount,
    ``/proc``)."""
    if not value:
        return "is empty; name the run folder"
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{value} exists and is not a folder"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{value} cannot be created: {existing} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vistrain-probe-", dir=existing))
    except OSError as error:
        if existing == path:
            return f"{value} cannot be written: making a folder in it fails ({error.strerror}); choose another folder"
        return (
            f"{value} cannot be created: making a folder in {existing} fails ({error.strerror}); "
            "choose another folder"
        )
    return None


def loadable_weights(value: str, catalog: Catalog) -> Problem:
    """ "" (random init), or a file / checkpoint folder / run folder whose files open."""
    return catalog.weights_problem(value) if value else None


# --------------------------------------------------------------------------------------------
# the table: dotted key -> rules its value must satisfy. "DATA.*" keys hold for DATA.TRAIN and
# DATA.TEST; which of them a job reads is decided in _data_sources below.

RUN_FOLDER_KEY = "CHECKPOINT.DIR"

RULES = {
    "JOB": [one_of("jobs")],
    "LOG_FREQUENCY": [at_least(1)],
    "MACHINE.DEVICE": [one_of(DEVICES)],
    "MACHINE.CPU_MMAP_THRESHOLD_MIB": [at_least(0)],
    "MACHINE.MEMORY_BUDGET_MIB": [at_least(0)],
    "MACHINE.INTER_NODE_GBPS": [at_least(0)],
    "DISTRIBUTED.BACKEND": [one_of(DIST_BACKENDS)],
    "DISTRIBUTED.NUM_NODES": [at_least(1)],
    "DISTRIBUTED.NUM_PROC_PER_NODE": [at_least(1)],
    "DISTRIBUTED.NODE_ID": [at_least(0)],
    "DISTRIBUTED.INIT_METHOD": [one_of(INIT_METHODS)],
    "DISTRIBUTED.TIMEOUT_SECONDS": [at_least(1)],
    "DATA.NUM_DATALOADER_WORKERS": [at_least(-1)],
    "DATA.*.BATCHSIZE_PER_REPLICA": [at_least(1)],
    # train_fit / train_select: the elpv source's sides inside train, for choosing recipes
    # (demo_digits refuses them; a folder without train/ and val/ ignores SPLIT, as for val)
    "DATA.*.SPLIT": [one_of(("train", "val", "train_fit", "train_select"))],
    "DATA.*.FOLDER_LABELS": [one_of(("auto", "subfolders", "none"))],
    "DATA.*.DECODE_SIZE": [at_least(0)],
    "DATA.*.SHUFFLE_WINDOW": [at_least(1)],
    "DATA.*.PIXEL_RANGE": [value_range],
    "DATA.CHANNELS": [at_least(1)],
    "DATA.NORMALIZE_FROM_IMAGES": [at_least(0)],
    "DATA.TRAIN.LABEL_FRACTION": [above(0), at_most(1)],
    "DATA.TRAIN.LABEL_SUBSET_SEED": [at_least(0)],
    "DATA.*.TRANSFORMS.NAME": [one_of("transforms")],
    "DATA.*.TRANSFORMS.HORIZONTAL_FLIP": [probability],
    "DATA.*.TRANSFORMS.BLUR_PROB": [probability],
    "DATA.*.TRANSFORMS.SOLARIZE_PROB": [probability],
    "DATA.*.TRANSFORMS.COLOR_DISTORTION": [at_least(0)],
    "MODEL.TRUNK.NAME": [one_of("trunks")],
    "MODEL.TRUNK.REGNET.NAME": [one_of("regnets")],
    "MODEL.TRUNK.IN_CHANNELS": [at_least(1)],
    "MODEL.TRUNK.RESNET.NAME": [one_of("resnets")],
    "MODEL.TRUNK.RESNET.WIDTH_MULTIPLIER": [above(0)],
    "MODEL.TRUNK.VIT.NAME": [one_of("vits")],
    "MODEL.TRUNK.VIT.POSITION_EMBEDDING": [one_of("vit_position_embeddings")],
    "MODEL.TRUNK.VIT.DROP_PATH_RATE": [at_least(0), below(1)],
    "MODEL.HEAD.NAME": [one_of("heads")],
    "MODEL.FSDP_CONFIG.BACKEND": [one_of("sharding backends")],
    "MODEL.FSDP_CONFIG.compute_dtype": [one_of("compute dtypes")],
    "MODEL.FSDP_CONFIG.shard_group_size": [at_least(0)],
    "MODEL.FSDP_CONFIG.wrap_granularity": [one_of(("block", "stage", "model"))],
    "MODEL.FSDP_CONFIG.prefetch_depth": [at_least(0)],
    "MODEL.AMP_PARAMS.AMP_DTYPE": [one_of("amp dtypes")],
    "MODEL.AMP_PARAMS.INIT_SCALE": [above(0)],
    "MODEL.AMP_PARAMS.GROWTH_FACTOR": [above(1)],
    "MODEL.AMP_PARAMS.BACKOFF_FACTOR": [above(0), below(1)],
    "MODEL.AMP_PARAMS.GROWTH_INTERVAL": [at_least(1)],
    "MODEL.SYNC_BN_CONFIG.GROUP_SIZE": [at_least(0)],
    "MODEL.ACTIVATION_CHECKPOINTING.GRANULARITY": [one_of(("block", "stage"))],
    "MODEL.WEIGHTS_INIT.PARAMS_FILE": [loadable_weights],
    "LOSS.NAME": [one_of("losses")],  # each method's section: its own rules (vistrain/methods)
    "OPTIMIZER.name": [one_of("optimizers")],
    "OPTIMIZER.num_epochs": [at_least(1)],
    "OPTIMIZER.update_freq": [at_least(1)],
    "OPTIMIZER.clip_grad_norm": [at_least(0)],
    "OPTIMIZER.head_lr_multiplier": [at_least(0)],
    "OPTIMIZER.layer_decay": [above(0), at_most(1)],
    "OPTIMIZER.param_schedulers.lr.name": [one_of("lr schedules")],
    "OPTIMIZER.param_schedulers.weight_decay.name": [one_of(("constant", "cosine"))],
    "OPTIMIZER.param_schedulers.weight_decay.end_value": [at_least(0)],
    "OPTIMIZER.param_schedulers.lr.warmup_epochs": [at_least(0)],
    "OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_lr_batch_size": [at_least(1)],
    RUN_FOLDER_KEY: [writable_folder],
    "CHECKPOINT.CHECKPOINT_FREQUENCY": [at_least(1)],
    "CHECKPOINT.STOP_GRACE_SECONDS": [above(0)],
    "BENCHMARK.POOL_SIZE": [at_least(1)],
    "BENCHMARK.FEATURE_VIEWS": [one_of("feature views")],
    "BENCHMARK.TRUNK_BN_STATS": [one_of("trunk BN statistics")],
    "BENCHMARK.LINEAR_LR_FOLDS": [at_least(1)],
    "BENCHMARK.KNN_K": [at_least(1)],
    "BENCHMARK.KNN_TEMPERATURE": [above(0)],
    "BENCHMARK.KNN_CHUNK_SIZE": [at_least(1)],
    "BENCHMARK.EXTRACT_SPLITS": [each_one_of(("TRAIN", "TEST"))],
    "BENCHMARK.WEIGHTS_FROM": [one_of("checkpoint networks")],
    "BENCHMARK.FINETUNE.LABEL_SMOOTHING": [at_least(0), below(1)],
    "BENCHMARK.FINETUNE.HOLDOUT_FRACTION": [above(0), below(1)],
    "MONITOR.EVERY_EPOCHS": [at_least(0)],
    "MONITOR.BATCHSIZE_PER_REPLICA": [at_least(0)],
    "MONITOR.LABEL_FRACTION": [above(0), at_most(1)],
    "MONITOR.NUM_IMAGES": [at_least(2)],
    "MONITOR.RANKME_MIN": [at_least(0)],
    "MONITOR.STD_MIN": [at_least(0), below(1)],
    "MONITOR.PROBE_LR": [above(0)],
    "MONITOR.PROBE_EPOCHS": [at_least(1)],
    "LOGGING.WANDB.MODE": [one_of(("", "online", "offline", "disabled"))],
    "LOOK.SPLIT": [one_of(("TRAIN", "TEST"))],
    "LOOK.MAX_IMAGES": [at_least(2)],
    "LOOK.MAP_METHODS": [each_one_of(("pca", "tsne", "umap"))],
    "LOOK.THUMBNAILS": [at_least(0)],
    "LOOK.QUERIES": [at_least(1)],
    "LOOK.NEIGHBOURS": [at_least(1)],
    "LOOK.ATTENTION_IMAGES": [at_least(1)],
    "LOOK.DUPLICATE_SIMILARITY": [above(-1), at_most(1)],
    "LOOK.OUTLIER_K": [at_least(1)],
    "LOOK.SHEET_ROWS": [at_least(1)],
}

# what DATA_PATHS entries a source reads: must exist and hold something
PATH_KINDS = {"disk_folder": "folder", "disk_filelist": "file", "hf_dataset": "folder or file"}
# DATA splits each engine reads (extract_features: BENCHMARK.EXTRACT_SPLITS)
SPLITS_READ = {
    "train": ("TRAIN",),
    "linear_eval": ("TRAIN", "TEST"),
    "knn": ("TRAIN", "TEST"),
    "finetune": ("TRAIN", "TEST"),
}
# the jobs that train or score with DATA.TRAIN's labels (DATA.TRAIN.LABEL_FRACTION)
LABELLED_JOBS = ("linear_eval", "knn", "finetune")


# --------------------------------------------------------------------------------------------
# public API


Rules = Mapping[str, Sequence[Callable]]  # dotted key -> rules, as RULES
CrossRule = Callable[[CfgNode, Catalog], Problem]


def check_config(
    cfg: CfgNode,
    catalog: Union[Catalog, Callable[[], Catalog]],
    rules: Optional[Rules] = None,
    cross_rules: Sequence[CrossRule] = (),
    files: bool = True,
) -> None:
    """Raise ConfigError (one line: key, problem, allowed values) for the first bad value.

    ``catalog`` may be a function building it: rules that need no registry run first, so most bad
    values are answered before the registries (and torch) are imported. ``rules`` and
    ``cross_rules`` are checked after :data:`RULES` and :data:`CROSS_RULES`: the methods' own
    (``vistrain.methods.check_config`` passes them). ``files=False`` skips the rules that read the
    file system (:data:`FILE_RULES`: the data paths and their samples, the run folder, the weights
    file): the planner plans a recipe from its config alone, on any machine.
    """
    deferred = _first_pass(cfg, rules or {}, cross_rules, files)
    if deferred:
        catalog = catalog() if callable(catalog) else catalog
        for check in deferred:
            _raise_problem(check(catalog))


def check_plain_values(cfg: CfgNode) -> None:
    """The rules of :data:`RULES` and :data:`CROSS_RULES` that need no registry (nothing imports
    torch): what the command line checks first, on the config loaded without the methods' keys."""
    _first_pass(cfg, {}, ())


def _first_pass(cfg: CfgNode, rules: Rules, cross_rules: Sequence[CrossRule], files: bool = True) -> list:
    """Apply every check that needs no catalog; return those that do."""
    deferred = []
    for check in _checks(cfg, rules, cross_rules, files):
        try:
            _raise_problem(check(_NoCatalog()))
        except _NeedsCatalog:
            deferred.append(check)
    return deferred


def check_world_size(cfg: CfgNode, world_size: int) -> None:
    """ConfigError (one line) for a value that must divide the job's world size, which only the
    launcher knows (torchrun and SLURM decide it): called once it has planned the job."""
    k = cfg.MODEL.FSDP_CONFIG.shard_group_size
    if cfg.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP and k > 0 and world_size % k != 0:
        raise ConfigError(
            f"MODEL.FSDP_CONFIG.shard_group_size ({k}) must divide the world size ({world_size}); "
            "use the ranks per node or another divisor, or 0 to shard over all ranks"
        )


class _NeedsCatalog(Exception):
    """A rule asked the first pass' placeholder catalog for something: run it in the second."""


class _NoCatalog:
    def __getattr__(self, name):
        raise _NeedsCatalog(name)


def _checks(
    cfg: CfgNode, rules: Rules, cross_rules: Sequence[CrossRule], files: bool = True
) -> Iterable[Callable[[Catalog], Problem]]:
    """Every rule applied to ``cfg``, in table order: functions of the catalog (without those of
    :data:`FILE_RULES` unless ``files``)."""
    for pattern, key_rules in (*RULES.items(), *rules.items()):
        for key in _expand(pattern):
            for rule in key_rules:
                if files or rule not in FILE_RULES:
                    yield functools.partial(_keyed, rule, key, get_key(cfg, key))
    for cross_rule in (*CROSS_RULES, *cross_rules):
        if files or cross_rule not in FILE_RULES:
            yield functools.partial(cross_rule, cfg)


def _keyed(rule: Callable, key: str, value, catalog: Catalog) -> Problem:
    problem = rule(value, catalog)
    return f"{key} {problem}" if problem else None


def _raise_problem(problem: Problem) -> None:
    if problem:
        raise ConfigError(problem)


def _expand(pattern: str) -> Iterable[str]:
    if pattern.startswith("DATA.*."):
        return [pattern.replace("*", split) for split in ("TRAIN", "TEST")]
    return [pattern]


def get_key(cfg: CfgNode, key: str):
    """The value of dotted ``key`` (``MODEL.FSDP_CONFIG.wrap_granularity``) in ``cfg``."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


# --------------------------------------------------------------------------------------------
# rules over several keys


def _splits_read(cfg: CfgNode) -> Sequence[str]:
    if cfg.JOB == "extract_features":
        return list(cfg.BENCHMARK.EXTRACT_SPLITS)
    return SPLITS_READ.get(cfg.JOB, ())


def _data_sources(cfg: CfgNode, catalog: Catalog) -> Problem:
    """Every split the job reads names known sources and one DATA_PATHS entry each."""
    for split in _splits_read(cfg):
        split_cfg, key = cfg.DATA[split], f"DATA.{split}"
        problem = each_one_of("data sources")(split_cfg.DATA_SOURCES, catalog)
        if problem:
            return f"{key}.DATA_SOURCES {problem}"
        if len(split_cfg.DATA_PATHS) != len(split_cfg.DATA_SOURCES):
            return (
                f"{key}.DATA_PATHS has {len(split_cfg.DATA_PATHS)} entries for "
                f"{len(split_cfg.DATA_SOURCES)} DATA_SOURCES; give one path per source"
            )
    return None


def _data_paths(cfg: CfgNode, _: Catalog) -> Problem:
    """The paths that a source reads exist and are not empty."""
    for split in _splits_read(cfg):
        split_cfg, key = cfg.DATA[split], f"DATA.{split}"
        for source, path in zip(split_cfg.DATA_SOURCES, split_cfg.DATA_PATHS):
            problem = _data_path_problem(PATH_KINDS.get(source), path)
            if problem:
                return f"{key}.DATA_PATHS: {source} {problem}"
    return None


def _data_path_problem(kind: Optional[str], path: str) -> Problem:
    if kind is None:
        return None  # synthetic / bundled data: no path read
    if not path:
        return f"needs a {kind}; DATA_PATHS entry is empty"
    if kind == "folder" and not os.path.isdir(path):
        return f"folder {path} does not exist"
    if kind == "folder" and not os.listdir(path):
        return f"folder {path} is empty"
    if kind == "file" and not os.path.isfile(path):
        return f"file {path} does not exist"
    if kind == "file" and os.path.getsize(path) == 0:
        return f"file {path} is empty"
    if kind == "folder or file" and not os.path.exists(path):
        return f"{path} does not exist"
    return None


def _trunk_features(cfg: CfgNode, catalog: Catalog) -> Problem:
    """MODEL.TRUNK.OUT_FEATURES (and, for benchmarks, BENCHMARK.FEATURES) name features the trunk
    has (``catalog.trunk_features``: the family's list); a BENCHMARK.FEATURES entry may pool a
    stage to its own side (``s2@4``) and join several by "+" (concatenated,
    ``vistrain.benchmarks.common.feature_parts``)."""
    try:
        valid = list(catalog.trunk_features(cfg.MODEL.TRUNK))
    except ValueError as error:  # e.g. a custom RegNet or ViT with impossible parameters
        return str(error).splitlines()[0]
    problem = each_one_of(valid)(cfg.MODEL.TRUNK.OUT_FEATURES, catalog)
    if problem:
        return f"MODEL.TRUNK.OUT_FEATURES {problem}"
    if cfg.JOB in ("linear_eval", "knn", "extract_features"):
        features = list(cfg.BENCHMARK.FEATURES)
        if not features or not all(
            _feature_part_ok(part, valid) for name in features for part in name.split("+")
        ):
            return (
                f"BENCHMARK.FEATURES must be a non-empty list of {', '.join(valid)} (a stage may add "
                f"'@P' to be pooled to P x P instead of POOL_SIZE; several joined by '+' are "
                f"concatenated, e.g. s2@4+s3); got {features}"
            )
    feature = cfg.BENCHMARK.FINETUNE.FEATURE
    if cfg.JOB == "finetune" and not _feature_part_ok(feature, valid):
        return (
            f"BENCHMARK.FINETUNE.FEATURE must be one of {', '.join(valid)} (a map may add '@P' to be "
            f"pooled to P x P, else POOL_SIZE); got {feature!r}"
        )
    return None


def _monitor_feature(cfg: CfgNode, _: Catalog) -> Problem:
    """The monitor reads its feature from the training trunk's outputs: MODEL.TRUNK.OUT_FEATURES."""
    feature, out = cfg.MONITOR.FEATURE, list(cfg.MODEL.TRUNK.OUT_FEATURES)
    if cfg.JOB != "train" or not cfg.MONITOR.EVERY_EPOCHS or not feature:
        return None
    if all(_feature_part_ok(part, out) for part in feature.split("+")):
        return None
    return (
        f"MONITOR.FEATURE must be one of MODEL.TRUNK.OUT_FEATURES {out} (a map may add '@P'; several "
        f"joined by '+'), or empty for the first; got {feature!r}"
    )


def _feature_part_ok(part: str, valid: Sequence[str]) -> bool:
    """``name`` or ``name@P`` (a stage map pooled to P x P, P >= 1; "avgpool" takes no P)."""
    feature, at, side = part.partition("@")
    if not at:
        return feature in valid
    return feature in valid and feature != "avgpool" and side.isdigit() and int(side) >= 1


def _head_fits_trunk(cfg: CfgNode, catalog: Catalog) -> Problem:
    """Training builds MODEL as configured (benchmarks swap the head for an identity): the head's
    input width must be the trunk's and the trunk must take every crop size (a ViT's patch size must
    divide them), found by building the model and running it on the meta device."""
    return catalog.model_problem(cfg) if cfg.JOB == "train" else None


def _one_global_batch(cfg: CfgNode, catalog: Catalog) -> Problem:
    """Every split read has samples, and under DROP_LAST at least one batch for every rank."""
    for split in _splits_read(cfg):
        split_cfg, key = cfg.DATA[split], f"DATA.{split}"
        try:
            samples = catalog.num_samples(split_cfg)
        except InputError as error:
            return f"{key}: {error}"
        batch = split_cfg.BATCHSIZE_PER_REPLICA
        world = catalog.world_size(cfg)
        if split_cfg.DROP_LAST and samples < batch * world:
            fits = f"{key}.BATCHSIZE_PER_REPLICA<={samples // world}" if samples >= world else "more data"
            return (
                f"{key} has {plural(samples, 'sample')}, fewer than one global batch ({plural(world, 'rank')} x "
                f"BATCHSIZE_PER_REPLICA {batch} = {batch * world}) with DROP_LAST; use {fits} "
                f"or {key}.DROP_LAST=False"
            )
    return None


def _feature_banks_complete(cfg: CfgNode, _: Catalog) -> Problem:
    """kNN and feature extraction need every image: a dropped last batch would lose some."""
    if cfg.JOB not in ("knn", "extract_features"):
        return None
    for split in _splits_read(cfg):
        if cfg.DATA[split].DROP_LAST:
            return f"DATA.{split}.DROP_LAST must be False to use every image of the split"
    return None


def _one_view_for_linear_eval(cfg: CfgNode, _: Catalog) -> Problem:
    """Linear evaluation and fine-tuning train on one view per image; extra crops would only cost time."""
    transforms = cfg.DATA.TRAIN.TRANSFORMS
    engine = {"linear_eval": "linear evaluation", "finetune": "fine-tuning"}.get(cfg.JOB)
    if engine is None or transforms.NAME != "multicrop" or sum(transforms.NUM_CROPS) == 1:
        return None
    return (
        f"{engine} uses one view per image, but DATA.TRAIN.TRANSFORMS.NUM_CROPS is "
        f"{list(transforms.NUM_CROPS)}; set NUM_CROPS=[1] (and one SIZE_CROPS / CROP_SCALES entry) "
        "or TRANSFORMS.NAME=eval"
    )


def _labels_only_where_used(cfg: CfgNode, _: Catalog) -> Problem:
    """A label fraction means something to the jobs that read labels; layer-wise lr decay to
    fine-tuning, whose model names its layers; the lr's scaling rule to pretraining."""
    if cfg.DATA.TRAIN.LABEL_FRACTION != 1 and cfg.JOB not in LABELLED_JOBS:
        return (
            f"DATA.TRAIN.LABEL_FRACTION is for the jobs that use labels ({', '.join(LABELLED_JOBS)}); "
            f"JOB {cfg.JOB} reads every image: set it to 1.0"
        )
    if cfg.OPTIMIZER.layer_decay != 1 and cfg.JOB != "finetune":
        return f"OPTIMIZER.layer_decay is for JOB finetune; JOB {cfg.JOB} trains at one lr: set it to 1.0"
    if cfg.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale and cfg.JOB != "train":
        return (
            f"OPTIMIZER.param_schedulers.lr.auto_lr_scaling scales pretraining's lr; JOB {cfg.JOB} "
            "trains at the lr it is given: set auto_scale=False"
        )
    return None


def _input_channels(cfg: CfgNode, _: Catalog) -> Problem:
    """The views have DATA.CHANNELS channels: a trunk taking another number would fail at its
    first convolution."""
    channels, views = cfg.MODEL.TRUNK.IN_CHANNELS, cfg.DATA.CHANNELS
    if channels != views and _splits_read(cfg):
        return (
            f"MODEL.TRUNK.IN_CHANNELS={channels}, but the views have DATA.CHANNELS={views}: set both to "
            f"the channels the trunk should see (DATA.CHANNELS={channels} to keep this trunk)"
        )
    return None


def _step_in_backward_is_exact(cfg: CfgNode, _: Catalog) -> Problem:
    """The step inside backward follows the built-in engine's reductions, and cannot wait for
    what needs every gradient first (the global norm, fp16 overflow checks)."""
    opt, fsdp, amp = cfg.OPTIMIZER, cfg.MODEL.FSDP_CONFIG, cfg.MODEL.AMP_PARAMS
    if not opt.step_in_backward or cfg.JOB != "train":
        return None
    if not fsdp.AUTO_SETUP_FSDP or fsdp.BACKEND != "builtin":
        return (
            "OPTIMIZER.step_in_backward needs the built-in sharded engine: set "
            "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True and MODEL.FSDP_CONFIG.BACKEND=builtin, or "
            "OPTIMIZER.step_in_backward=False"
        )
    if opt.clip_grad_norm > 0:
        return (
            "OPTIMIZER.step_in_backward cannot clip the global gradient norm (it needs every "
            "gradient before the first step): set OPTIMIZER.clip_grad_norm=0 or "
            "OPTIMIZER.step_in_backward=False"
        )
    if amp.USE_AMP and amp.AMP_DTYPE == "float16":
        return (
            "OPTIMIZER.step_in_backward cannot skip a step on an fp16 overflow (found only once "
            "every gradient is in): use MODEL.AMP_PARAMS.AMP_DTYPE=bfloat16 or "
            "OPTIMIZER.step_in_backward=False"
        )
    return None


def _wandb_installed(cfg: CfgNode, _: Catalog) -> Problem:
    """LOGGING.WANDB needs the wandb extra (looked up, not imported)."""
    if cfg.LOGGING.WANDB.ENABLED and importlib.util.find_spec("wandb") is None:
        return 'LOGGING.WANDB.ENABLED needs wandb: pip install "vistrain[wandb]"'
    return None


CROSS_RULES = (
    _wandb_installed,
    _input_channels,
    _data_sources,
    _data_paths,
    _one_global_batch,
    _trunk_features,
    _head_fits_trunk,
    _feature_banks_complete,
    _one_view_for_linear_eval,
    _labels_only_where_used,
    _step_in_backward_is_exact,
    _monitor_feature,
)

# rules that read the file system (skipped by ``check_config(..., files=False)``)
FILE_RULES = frozenset((writable_folder, loadable_weights, _data_paths, _one_global_batch))
