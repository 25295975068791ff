"""World-size independent sharded checkpoints, conversion and weight initialisation.

    path = save_sharded_checkpoint(run_dir, iteration, model, optimizer, extra, metadata, keep_last)
    state = load_sharded_checkpoint(find_latest_checkpoint(run_dir), model, optimizer)  # any world size
    report = load_pretrained(plain_model, cfg.MODEL.WEIGHTS_INIT)

The on-disk layout is described in :mod:`vistrain.engine.checkpoint` and :mod:`.save`.
"""

from vistrain.checkpoint.convert import consolidate, consolidated_state_dict, describe, to_torchvision
from vistrain.checkpoint.files import (CheckpointError, find_latest_checkpoint, is_complete, list_checkpoints,
                                       read_metadata)
from vistrain.checkpoint.load import load_sharded_checkpoint
from vistrain.checkpoint.pretrained import LoadReport, load_pretrained
from vistrain.checkpoint.rng import capture_rng, restore_rng
from vistrain.checkpoint.save import save_sharded_checkpoint

__all__ = [
    "CheckpointError", "LoadReport", "capture_rng", "consolidate", "consolidated_state_dict", "describe",
    "find_latest_checkpoint", "is_complete", "list_checkpoints", "load_pretrained", "load_sharded_checkpoint",
    "read_metadata", "restore_rng", "save_sharded_checkpoint", "to_torchvision",
]
