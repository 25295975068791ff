"""Who this process is in a job, read from the environment without loading torch: the command line
needs it before torch is imported, to let one process per job speak (global rank 0)."""

from typing import Mapping


def job_rank(environ: Mapping[str, str]) -> int:
    """Global rank of this process in a job torchrun or srun started (as
    ``vistrain.distributed.join.joined_job`` reads it); 0 otherwise: a launcher, or an environment
    too broken to say (the launcher then reports that)."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        value = environ.get("RANK", "0")
    elif "SLURM_PROCID" in environ and environ.get("SLURM_NTASKS", "1") not in ("", "0", "1"):
        value = environ["SLURM_PROCID"]
    else:
        return 0
    return int(value) if value.isdigit() else 0
