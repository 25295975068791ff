"""Build a run's config: defaults <- configs/NAME.yaml (its ``_BASE_`` chain first) <- overrides.

Command line grammar (the same as VISSL's, without Hydra)::

    config=pretrain/simclr_regnet          # configs/pretrain/simclr_regnet.yaml, or a path to a .yaml
    config.OPTIMIZER.num_epochs=2          # any existing key; the value is a YAML literal

Every key must already exist in the defaults (``vistrain/config/defaults.py`` and, for the methods'
sections LOSS and MODEL.HEAD, the method files: ``vistrain.methods.load_config`` passes their keys
here), and every value must have the default's type (an int is accepted for a float). Anything else
is a :class:`ConfigError` whose one-line message names the key, and for a misspelled key the closest
valid one, so a typo never silently trains the wrong model. Without the methods' keys those two
sections take any key as given (``new_allowed``): the command line's first look, before torch.
"""

import difflib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Set, Tuple

import yaml
from fvcore.common.config import CfgNode

from vistrain.config.defaults import FOLLOWS, get_defaults
from vistrain.config.errors import ConfigError


def _configs_dir() -> Path:
    """Where ``config=NAME`` looks: ``configs/`` of the source checkout this package runs from (the
    place a reader edits), else the recipes installed with the package (``vistrain.configs``,
    which setup.py maps from ``configs/``) after a plain ``pip install .``."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "setup.py").is_file() and (checkout / "configs").is_dir():
        return checkout / "configs"
    installed = importlib.util.find_spec("vistrain.configs")
    if installed is not None and installed.submodule_search_locations:
        return Path(next(iter(installed.submodule_search_locations)))
    return checkout / "configs"


class SafeLoader12(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose floats follow YAML 1.2: ``3e-4``, ``1e8``, ``1.0e8``, ``-2E-3`` are
    floats. YAML 1.1 (PyYAML's default) wants a dot and a signed exponent, so learning rates as
    everybody writes them would be strings. Everything else is as ``yaml.safe_load`` reads it."""


# exponent forms YAML 1.1 misses: no dot, or an unsigned exponent (dotted, signed ones it reads itself)
SafeLoader12.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(stream):
    """``yaml.safe_load`` with YAML 1.2 floats (:class:`SafeLoader12`): a file or a string."""
    return yaml.load(stream, Loader=SafeLoader12)  # a SafeLoader subclass: no code runs


CONFIGS_DIR = _configs_dir()
BASE_KEY = "_BASE_"
_NO_RAW = object()  # marks values that did not come from command-line text


# --------------------------------------------------------------------------------------------
# public API


def load_config(argv: Sequence[str], methods: Optional[CfgNode] = None) -> CfgNode:
    """Resolve ``argv`` (``config=NAME`` and ``config.A.B=VALUE`` items) into a frozen CfgNode.

    The recipe is applied first, then the overrides in order, whatever their position in argv.
    Raises ConfigError for any bad item. ``methods``: the keys the methods declare (see
    :func:`vistrain.config.defaults.get_defaults`); a run's config comes from
    ``vistrain.methods.load_config(argv)``, which passes them.
    """
    name, overrides = _parse_argv(argv)
    cfg = get_defaults(methods)
    if name is not None:
        _merge_file(cfg, resolve_config_path(name), chain=())
    for key, text in overrides:
        if key == "VERSION":
            raise ConfigError("VERSION is set by vistrain itself (it tells which key layout a config uses)")
        _set_key(cfg, key, _parse_literal(key, text), raw=text, where="command line")
    _follow(cfg, explicit_keys(argv))
    cfg.freeze()
    return cfg


def _follow(cfg: CfgNode, explicit: Set[str]) -> None:
    """Keys of ``FOLLOWS`` that ``explicit`` (the keys the recipe and overrides set) leaves out
    take the value of the key they follow."""
    for key, leader in FOLLOWS.items():
        if key not in explicit:
            *path, last = key.split(".")
            section = cfg
            for part in path:
                section = section[part]
            section[last] = _get(cfg, leader)


def _get(cfg: CfgNode, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def require_recipe(argv: Sequence[str]) -> None:
    """ConfigError (one line, listing the shipped recipes) unless ``argv`` names one with
    ``config=``: overrides alone would silently train the defaults (synthetic images, one rank).
    The commands call it; :func:`load_config` itself accepts overrides alone (tests, notebooks)."""
    if _parse_argv(argv)[0] is None:
        raise ConfigError(
            f"no recipe given: add config=NAME, one of {', '.join(available_configs())} "
            "(config=regnet_fsdp is the quick start); overrides alone would train the defaults on synthetic images"
        )


def explicit_keys(argv: Sequence[str]) -> Set[str]:
    """Dotted keys that ``argv`` sets: in the recipe, its ``_BASE_`` chain, or an override (what
    the auto-tuner keeps as set). Call after :func:`load_config` accepted ``argv``."""
    name, overrides = _parse_argv(argv)
    keys = {key for key, _ in overrides}
    if name is not None:
        keys |= _keys_in_file(resolve_config_path(name))
    return keys


def _keys_in_file(path: Path) -> Set[str]:
    data = _read_yaml(path.resolve())
    bases = data.pop(BASE_KEY, [])
    keys = set(_dotted(data))
    for base in bases if isinstance(bases, list) else [bases]:
        keys |= _keys_in_file(_resolve_base(path.resolve(), base))
    return keys


def _dotted(data: dict, prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def save_config(cfg: CfgNode, path: str) -> None:
    """Write the resolved ``cfg`` as YAML to ``path`` (atomically); ``config=path`` reloads it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(cfg.dump())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def available_configs() -> List[str]:
    """Names accepted by ``config=NAME``: YAML files below configs/, without the suffix."""
    return sorted(str(p.relative_to(CONFIGS_DIR).with_suffix("")) for p in CONFIGS_DIR.rglob("*.yaml"))


def resolve_config_path(name: str) -> Path:
    """``config=`` value -> YAML file: a path to a .yaml file, or a name below configs/."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            path = CONFIGS_DIR / name  # also accept "test/tiny.yaml" relative to configs/
        if not path.is_file():
            raise ConfigError(f"config file not found: {name}")
        return path
    path = CONFIGS_DIR / f"{name}.yaml"
    if not name or not path.is_file():
        names = ", ".join(available_configs()) or f"none (no .yaml files below {CONFIGS_DIR})"
        raise ConfigError(f"unknown config '{name}'; available: {names}")
    return path


# --------------------------------------------------------------------------------------------
# command line


def _parse_argv(argv: Sequence[str]) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """Split argv into the recipe name (or None) and (KEY, VALUE-text) overrides."""
    name, overrides = None, []
    for arg in argv:
        if arg == "config" or arg.startswith("config="):
            if name is not None:
                raise ConfigError(f"config= given twice ('{name}' and '{arg[7:]}')")
            name = arg[len("config=") :]
            if not name:
                raise ConfigError("config= needs a name, e.g. config=regnet_fsdp")
        elif arg.startswith("config."):
            key, sep, text = arg[len("config.") :].partition("=")
            if not sep:
                raise ConfigError(f"override {arg} has no value; write {arg}=VALUE")
            if not key:
                raise ConfigError(f"override {arg} names no key; write config.A.B=VALUE")
            overrides.append((key, text))
        else:
            raise ConfigError(f"argument '{arg}' must start with config: config=NAME or config.KEY=VALUE")
    return name, overrides


def _parse_literal(key: str, text: str) -> Any:
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"cannot parse value of {key}: {text!r} is not a YAML literal ({problem})"
        ) from None


# --------------------------------------------------------------------------------------------
# YAML files


def _merge_file(cfg: CfgNode, path: Path, chain: Tuple[Path, ...]) -> None:
    """Merge ``path`` into ``cfg``: its ``_BASE_`` files first (in order), then its own keys.

    Applying files one after the other with recursive merging gives the same result as fvcore's
    ``load_yaml_with_base`` dict merge, but lets every error name the file it comes from.
    """
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(_show(p) for p in chain + (path,))
        raise ConfigError(f"_BASE_ chain is cyclic: {cycle}")
    data = _read_yaml(path)
    _check_version(cfg, data, path)
    bases = data.pop(BASE_KEY, [])
    for base in bases if isinstance(bases, list) else [bases]:
        _merge_file(cfg, _resolve_base(path, base), chain + (path,))
    _merge_mapping(cfg, data, where=_show(path))


def _check_version(cfg: CfgNode, data: dict, path: Path) -> None:
    """A file that names a VERSION (every saved config.yaml does) must match this vistrain's."""
    if "VERSION" in data and data["VERSION"] != cfg.VERSION:
        raise ConfigError(
            f"{_show(path)}: written for config VERSION {data['VERSION']!r}, this vistrain reads "
            f"VERSION {cfg.VERSION}; recreate it from a recipe (config=NAME) instead"
        )


def _read_yaml(path: Path) -> dict:
    try:
        with open(path) as f:
            data = load_yaml(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{_show(path)}: invalid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_show(path)}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _resolve_base(path: Path, base: Any) -> Path:
    if not isinstance(base, str):
        raise ConfigError(f"{_show(path)}: _BASE_ must be a file name or a list of them, got {base!r}")
    # like fvcore: absolute or ~ paths as given, others relative to the including file
    target = Path(base).expanduser()
    if not target.is_absolute():
        target = path.parent / target
    if not target.is_file():
        raise ConfigError(f"{_show(path)}: _BASE_ file not found: {base}")
    return target


def _show(path: Path) -> str:
    try:
        return str(path.relative_to(CONFIGS_DIR))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------
# key lookup and type checking


def _merge_mapping(cfg: CfgNode, data: dict, where: str) -> None:
    for key, value in data.items():
        _set_key(cfg, str(key), value, raw=_NO_RAW, where=where)


def _set_key(cfg: CfgNode, key: str, value: Any, raw: Any, where: str) -> None:
    """Set dotted ``key`` of ``cfg`` to ``value`` after checking that it exists and its type.

    A mapping given for a section is merged key by key (YAML files); ``raw`` is the command-line
    text of the value, or _NO_RAW.
    """
    parts = key.split(".")
    node = cfg
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None and node.is_new_allowed():
            _insert_new(node, parts[depth:], value)
            return
        if not isinstance(child, CfgNode):
            raise ConfigError(f"{_where(where)}{_unknown_key_message(cfg, key, value)}")
        node = child
    if parts[-1] not in node:
        if not node.is_new_allowed():
            raise ConfigError(f"{_where(where)}{_unknown_key_message(cfg, key, value)}")
        _insert_new(node, parts[-1:], value)
        return
    old = node[parts[-1]]
    if isinstance(old, CfgNode):
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(where)}{key} is a section, not a value; set one of its keys")
        for sub, sub_value in value.items():
            _set_key(cfg, f"{key}.{sub}", sub_value, raw=_NO_RAW, where=where)
        return
    node[parts[-1]] = _checked(key, old, value, raw, where)


def _insert_new(node: CfgNode, parts: List[str], value: Any) -> None:
    """Below a ``new_allowed`` node, keys unknown to the defaults are created (no type to check)."""
    for part in parts[:-1]:
        node = node.setdefault(part, CfgNode(new_allowed=True))
    node[parts[-1]] = CfgNode(value, new_allowed=True) if isinstance(value, dict) else value


def _checked(key: str, default: Any, value: Any, raw: Any, where: str) -> Any:
    """``value`` converted to the type of ``default``; ConfigError naming key and value if it can't be."""
    # Command-line text for a str key is taken verbatim (RUN_ID=10.0.0.1:2950, DIR=2024), so users
    # need no YAML quoting in their shell.
    if isinstance(default, str) and raw is not _NO_RAW and not isinstance(value, str):
        return raw
    converted = _convert(default, value)
    if converted is _MISMATCH:
        shown = raw if raw is not _NO_RAW else value
        raise ConfigError(
            f"{_where(where)}config key {key} expects {_type_name(default)}, got {shown!r}{_int_hint(default, value)}"
        )
    return converted


def _int_hint(default: Any, value: Any) -> str:
    """For an int key given a whole float (``1e3``): the integer to write instead."""
    whole = isinstance(value, float) and value.is_integer() and abs(value) < 2**63
    if isinstance(default, int) and not isinstance(default, bool) and whole:
        return f"; write it as an integer: {int(value)}"
    return ""


_MISMATCH = object()


def _convert(default: Any, value: Any) -> Any:
    if isinstance(default, bool):
        return value if isinstance(value, bool) else _MISMATCH
    if isinstance(default, int):
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISMATCH
    if isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok else _MISMATCH
    if isinstance(default, str):
        return value if isinstance(value, str) else _MISMATCH
    if isinstance(default, (list, tuple)):
        return _convert_list(default, value)
    return value if type(value) is type(default) else _MISMATCH


def _convert_list(default: Sequence, value: Any) -> Any:
    if not isinstance(value, (list, tuple)):
        return _MISMATCH
    # elements are checked against the default's first element when the default is homogeneous
    proto = default[0] if default and all(type(d) is type(default[0]) for d in default) else None
    if proto is None:
        return list(value)
    items = [_convert(proto, v) for v in value]
    return _MISMATCH if any(i is _MISMATCH for i in items) else items


def _type_name(default: Any) -> str:
    if isinstance(default, (list, tuple)):
        if default and all(type(d) is type(default[0]) for d in default):
            return f"a list of {_type_name(default[0])}"
        return "a list"
    return type(default).__name__


def _where(where: str) -> str:
    return "" if where == "command line" else f"{where}: "


# keys VISSL users know under another name
RENAMED_KEYS = {"ENGINE_NAME": "JOB"}


def _unknown_key_message(root: CfgNode, key: str, value: Any = None) -> str:
    """``root``: the config being loaded (its defaults' keys are the candidates)."""
    if key in RENAMED_KEYS:
        return f"config key {key} is called {RENAMED_KEYS[key]} here (what a run does); set {RENAMED_KEYS[key]}={value}"
    while isinstance(value, dict) and value:  # name a full leaf path: "MODEL.HAED.NAME", not "MODEL.HAED"
        sub, value = next(iter(value.items()))
        key = f"{key}.{sub}"
    # Full paths share long prefixes, so also ask the last names to look alike: "OPTIMIZER.zzz"
    # should not suggest "OPTIMIZER.name". Among look-alikes, those in the key's own section come
    # first: "DATA.TRAIN.BATCHSIZE" means DATA.TRAIN.BATCHSIZE_PER_REPLICA, not a PATCH_SIZE.
    scored = []
    for candidate in _all_key_paths(root):
        full = difflib.SequenceMatcher(None, key, candidate).ratio()
        leaf = difflib.SequenceMatcher(None, key.rsplit(".", 1)[-1], candidate.rsplit(".", 1)[-1]).ratio()
        if full >= 0.6 and leaf >= 0.5:
            scored.append((_shared_sections(key, candidate), full + leaf, candidate))
    if scored:
        return f"unknown config key {key}; did you mean {max(scored)[2]}?"
    section = _deepest_section(root, key)
    where = f" in {section[0]}" if section[0] else ""
    return f"unknown config key {key}; valid keys{where}: {', '.join(sorted(section[1].keys()))}"


def _shared_sections(key: str, candidate: str) -> int:
    """How many leading sections (all but the last name) two dotted keys share."""
    shared = 0
    for a, b in zip(key.split(".")[:-1], candidate.split(".")[:-1]):
        if a != b:
            break
        shared += 1
    return shared


def _all_key_paths(node: CfgNode, prefix: str = "") -> Iterator[str]:
    """Full dotted paths of the leaf keys below ``node``."""
    for name, value in node.items():
        if isinstance(value, CfgNode):
            yield from _all_key_paths(value, f"{prefix}{name}.")
        else:
            yield prefix + name


def _deepest_section(root: CfgNode, key: str) -> Tuple[str, CfgNode]:
    node, path = root, []
    for part in key.split(".")[:-1]:
        child = node.get(part)
        if not isinstance(child, CfgNode):
            break
        node = child
        path.append(part)
    return ".".join(path), node
