"""Names the wrapper adds to a module tree, and how to strip them back to the original names."""

WRAPPED_NAME = "_fsdp_wrapped_module"  # attribute holding the wrapped module inside each unit
FLAT_PARAM_PREFIX = "flat_param_"  # attributes holding a unit's flat shards


def clean_name(name: str) -> str:
    """Drop wrapper path components: 'a._fsdp_wrapped_module.b' -> 'a.b'."""
    return name.replace(WRAPPED_NAME + ".", "").replace("." + WRAPPED_NAME, "").replace(WRAPPED_NAME, "")


def is_shard_key(key: str) -> bool:
    """A state-dict key of a flat shard (local state dicts hold them; full ones never do)."""
    return key.rsplit(".", 1)[-1].startswith(FLAT_PARAM_PREFIX)
