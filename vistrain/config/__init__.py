"""Config: every key with its default (defaults.py), recipes in configs/, typo-proof overrides (loader.py).

The methods' own keys (LOSS.<name>, their heads' MODEL.HEAD keys) are declared in their files, a layer
above: a run's config comes from ``vistrain.methods.load_config``, which hands them to this layer."""

from vistrain.config.defaults import get_defaults  # noqa: F401
from vistrain.config.errors import (  # noqa: F401
    ConfigError,
    DataError,
    DivergedError,
    InputError,
    OneLineExit,
    StopRequested,
)
from vistrain.config.loader import (  # noqa: F401
    available_configs,
    explicit_keys,
    load_config,
    require_recipe,
    resolve_config_path,
    save_config,
)
