"""Process groups, launching, collectives that are no-ops in one process, CPU-capable sync BN."""

from vistrain.distributed.comm import (  # noqa: F401
    all_gather_no_grad,
    all_gather_object,
    all_gather_with_grad,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    get_local_rank,
    get_rank,
    get_world_size,
    is_dist,
    is_main_process,
)
