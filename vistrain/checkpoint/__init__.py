"""World-size independent sharded checkpoints, conversion and weight initialisation.

    path = save_sharded_checkpoint(run_dir, iteration, model, optimizer, extra, metadata, keep_last)
    write_sharded_checkpoint(path, iteration, model, optimizer, extra, metadata)   # any folder name
    state = load_sharded_checkpoint(find_latest_checkpoint(run_dir), model, optimizer)  # any world size
    report = load_pretrained(plain_model, cfg.MODEL.WEIGHTS_INIT)

The file format (the one description; the modules below refer here). A run folder holds
``checkpoint_<iteration>/`` folders, each::

    rank<r>.pt      written by rank r, in parallel with the others (a dict, ``weights_only``):
                      format, rank, world_size
                      params:    {fqn: {"start": int, "values": 1-D tensor}}  ORIGINAL-parameter
                                 slices rank r owns (a DDP model: rank 0 writes them whole;
                                 hybrid sharding: the first replica's ranks, one copy; a
                                 momentum teacher's under ``teacher.<fqn>``, sharded alike)
                      optimizer: {"tensors": {state key: {fqn: {"start", "values"}}}, e.g.
                                              momentum_buffer, exp_avg, exp_avg_sq
                                  "scalars": {fqn: {state key: value}}}    e.g. step
                      buffers:   {name: tensor}                 rank 0 only (BatchNorm statistics)
                      rng:       rank r's RNG states (rng.py)
                      extra:     rank r's extra state: {"loss": the loss's state dict (SwAV
                                 queue), "grad_scaler": ...}
    metadata.json   written LAST by rank 0: every original parameter (fqn, shape, dtype,
                    requires_grad, ``slices`` = [rank, start, length] of the files holding it),
                    buffers, the optimizer class / state kinds / param groups, iteration, epoch,
                    iteration_in_epoch, iters_per_epoch, global_batch, num_samples,
                    samples_seen (= epoch * num_samples + iteration_in_epoch * global_batch),
                    world size, config, vistrain and torch versions.

A save writes into ``checkpoint_<it>.tmp/`` (files fsync'd) and rank 0 renames the folder after
every rank finished, so a crash or a full disk never leaves a half checkpoint under a final name;
a folder with its final name and a ``metadata.json`` is complete. Checkpoints are ranked by
``samples_seen``, not by the iteration in their name (which means different progress at different
world sizes): "latest" and pruning follow it (files.py). One whose metadata.json or a rank file
cannot be read is skipped; a resuming run renames it ``checkpoint_<it>.corrupt``. Reading never executes code
(``torch.load(weights_only=True)``); a bad file is a one-line :class:`CheckpointError`.

Resume on any world size M (saved by N ranks): each rank reads only the bytes of the slices
overlapping its shards and rebuilds its shards and optimizer state exactly; the position in
the epoch is mapped through the samples seen (progress.py). Per-rank state (RNG, SwAV queue) is
restored only when the world size is unchanged.

Nothing reads or writes a whole model at once (tensor_file.py): a rank file or ``.pt`` is opened
as its structure (meta tensors, with each storage's place in the file) and each tensor, or slice
of one, is read by itself into its destination; ``WEIGHTS_INIT`` on a meta model reads a unit's
tensors when the sharded engine creates that unit; the conversions write their one output file
tensor by tensor.
"""

from vistrain.checkpoint.convert import consolidate, consolidated_state_dict, describe
from vistrain.checkpoint.export import Export, to_safetensors, to_timm, to_torchvision
from vistrain.checkpoint.files import (
    CheckpointError,
    find_latest_checkpoint,
    is_complete,
    list_checkpoints,
    read_metadata,
    set_aside,
)
from vistrain.checkpoint.load import load_sharded_checkpoint
from vistrain.checkpoint.pretrained import LoadReport, load_pretrained
from vistrain.checkpoint.progress import EpochLayout, resume_iteration
from vistrain.checkpoint.rng import capture_rng, restore_rng
from vistrain.checkpoint.save import save_sharded_checkpoint, write_sharded_checkpoint

__all__ = [
    "CheckpointError",
    "EpochLayout",
    "Export",
    "LoadReport",
    "capture_rng",
    "consolidate",
    "consolidated_state_dict",
    "describe",
    "find_latest_checkpoint",
    "is_complete",
    "list_checkpoints",
    "load_pretrained",
    "load_sharded_checkpoint",
    "read_metadata",
    "restore_rng",
    "resume_iteration",
    "save_sharded_checkpoint",
    "set_aside",
    "to_safetensors",
    "to_timm",
    "to_torchvision",
    "write_sharded_checkpoint",
]
