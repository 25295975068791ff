"""This process's random number generator states as tensors and plain values.

Stored in each rank's checkpoint file, so they must pass ``torch.load(weights_only=True)``:
numpy's key array becomes an int64 tensor, Python's state tuple a list.
"""

import random

import numpy as np
import torch


def capture_rng() -> dict:
    """torch (CPU), numpy, Python and, when CUDA is in use, every CUDA device's state."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng` (CUDA states only when CUDA is in use here too)."""
    torch.set_rng_state(state["torch"].clone())
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.clone() for s in states])
