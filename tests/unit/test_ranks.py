"""memlm.ranks: one process is rank 0 of 1 with or without a process group.
(Groups of 2-4 ranks go through these helpers in the checkpoint, preemption
and non-finite tests under tests/integration and tests/faults.)"""

import torch
import torch.distributed as dist

from memlm.ranks import collective_device, group_barrier, group_rank, group_size, many_ranks


def _place() -> tuple:
    group_barrier()
    return group_rank(), group_size(), many_ranks(), collective_device()


def test_one_process_without_a_group_is_rank_0_of_1():
    assert not dist.is_initialized()
    assert _place() == (0, 1, False, torch.device("cpu"))


def test_a_one_rank_gloo_group_is_rank_0_of_1_on_the_cpu(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert _place() == (0, 1, False, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
