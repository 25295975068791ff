"""Run a function on N real gloo processes and collect what each rank returns (tests, benchmarks)."""

import contextlib
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vistrain.distributed.launch import find_free_port


def _worker(rank, world_size, port, fn, args, result_dir, backend):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(result_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(result_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, backend: str = "gloo"):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    ``fn`` must be importable (module level). Results travel through ``torch.save``, so return
    tensors, numbers, lists and dicts. A failure on any rank raises with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        # on failure the per-rank files below carry the real traceback
        with contextlib.suppress(mp.ProcessRaisedException):
            mp.start_processes(
                _worker,
                args=(world_size, find_free_port(), fn, args, result_dir, backend),
                nprocs=world_size,
                start_method="fork" if _can_fork() else "spawn",
            )
        results = []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} died without a result")
            out = torch.load(path, weights_only=True)
            if not out["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{out['error']}")
            results.append(out["result"])
        return results


def _can_fork() -> bool:
    # fork is much faster than spawn; it is safe while no CUDA context exists in the parent.
    return not torch.cuda.is_initialized()
