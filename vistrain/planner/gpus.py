"""Memory of common data-centre GPUs, for planning a GPU run on any machine (``--gpu NAME``).

Nothing here imports torch: the command line lists the names at once.
"""

from typing import Dict

# name -> total memory in MiB as nvidia-smi reports it (the auto-tuner plans for 90% of it)
GPUS: Dict[str, float] = {
    "v100-32gb": 32_768,
    "a100-40gb": 40_960,
    "a100-80gb": 81_920,
    "l4-24gb": 23_034,
    "l40s-48gb": 46_068,
    "h100-80gb": 81_559,
    "h200-141gb": 143_771,
}
