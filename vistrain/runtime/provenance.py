"""Where a run came from: ``CHECKPOINT.DIR/provenance.json``, one record per launch.

Rank 0 appends a record when a job really starts (beside ``config.yaml``, see
``vistrain.runtime.run_setup.record_config``), so a run folder resumed three times holds four:
``{"launches": [record, ...]}``, oldest first. A record holds what reproducing the run needs
besides its config: the vistrain version and, when vistrain runs from a git checkout, its commit
and whether the checkout had uncommitted changes; the Python, torch, CUDA and cuDNN versions and
the installed extras' versions (``null``: not installed); the full command line and working
folder; the host, the device, the number of ranks; the job, the time (UTC) and the iteration the
run resumed from (0: a fresh start).
"""

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from typing import Dict, Optional

import torch

import vistrain
from vistrain.distributed import comm

FILE = "provenance.json"


def launch_record(job: str, device: torch.device, resumed_from: int = 0) -> dict:
    """This launch's provenance (module docstring); ``device``: this rank's."""
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "job": job,
        "resumed_from": resumed_from,
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "device": device_name(device),
        "world_size": comm.get_world_size(),
        "vistrain": vistrain.__version__,
        "git": git_state(os.path.dirname(os.path.abspath(vistrain.__file__))),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # asked only on a GPU: the question loads cuDNN (about 90 MiB more resident on a CPU rank)
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "extras": extras_versions(),
    }


def append_record(run_dir: str, record: dict) -> str:
    """Add ``record`` to ``run_dir/provenance.json`` (written atomically); returns its path. An
    unreadable file is kept as ``provenance.json.unreadable`` and a new one started."""
    path = os.path.join(run_dir, FILE)
    launches = []
    if os.path.isfile(path):
        try:
            with open(path) as f:
                launches = list(json.load(f)["launches"])
        except (ValueError, KeyError, TypeError):
            os.replace(path, f"{path}.unreadable")
    with open(f"{path}.tmp", "w") as f:
        json.dump({"launches": [*launches, record]}, f, indent=1)
    os.replace(f"{path}.tmp", path)
    return path


def device_name(device: torch.device) -> str:
    """``cuda: <GPU name>`` or ``cpu: <processor>`` (the processor as the OS names it)."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {_cpu_model() or platform.processor() or platform.machine()}"


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def git_state(package_dir: str) -> Optional[Dict[str, object]]:
    """``{"commit": sha, "dirty": bool}`` of the git checkout ``package_dir`` (vistrain's own
    folder) is part of; None when it is in none (an installed wheel) or git is missing. A checkout
    that only contains vistrain installed elsewhere (a venv inside a user's repository) is not it."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", package_dir, *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if os.path.realpath(os.path.join(top, "vistrain")) != os.path.realpath(package_dir):
            return None
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError):
        return None


def extras_versions() -> Dict[str, Optional[str]]:
    """``{distribution: version or None}`` of every package vistrain's optional extras name (its
    installed metadata's ``extra == ...`` requirements, the "dev" tools aside)."""
    try:
        requirements = importlib.metadata.requires("vistrain") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {}
    names = set()
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        if "extra" in marker and "dev" not in re.findall(r"extra\s*==\s*['\"]([^'\"]+)", marker):
            names.add(re.split(r"[<>=!~\[ ]", name.strip(), maxsplit=1)[0])
    return {name: _version(name) for name in sorted(names)}


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
