"""This process's place in the default process group, for code that runs alike with one process or many.

    from memlm.ranks import collective_device, group_barrier, group_rank, group_size, many_ranks
    if group_rank() == 0:
        print(...)                        # rank 0 speaks (the only rank without a group)
    group_barrier()                       # a no-op without a group
    if many_ranks():                      # a collective is needed only then
        flag = torch.ones(1, device=collective_device())
        dist.all_reduce(flag)

Without an initialized group (one process, or before `init_distributed`)
this process is rank 0 of 1. What the launcher set before the group exists
is `memlm.errors.launcher_rank`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _open() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_rank() -> int:
    """This process's rank in the default group; 0 without one."""
    return dist.get_rank() if _open() else 0


def group_size() -> int:
    """The default group's world size; 1 without one."""
    return dist.get_world_size() if _open() else 1


def many_ranks() -> bool:
    """Whether a group of more than one rank is open: only then does a collective have peers."""
    return group_size() > 1


def group_barrier() -> None:
    """Wait for every rank of the default group; a no-op without one."""
    if _open():
        dist.barrier()


def collective_device() -> torch.device:
    """Where a tensor for a default-group collective lives: this rank's GPU under NCCL, else the CPU (gloo)."""
    if _open() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
