"""Run a function on N CPU ranks (gloo) from a test, like torchrun would.

Workers live in this importable module (tests/ is on pytest's pythonpath) so
spawned processes can unpickle them."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, device: str, backend: str | None, per_node: int, fn: Callable,
           args: tuple) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
    })
    torch.set_num_threads(1)
    from memlm.distributed.env import ProcessGroup

    with ProcessGroup(device, backend) as env:  # as the train CLI opens and ends a torchrun rank
        assert env.rank == rank and env.world_size == world
        fn(rank, *args)


def run_ranks(fn: Callable, world: int, *args, device: str = "cpu", backend: str | None = None,
              per_node: int | None = None) -> None:
    """Call fn(rank, *args) in `world` processes joined in one process group, opened and
    closed as a command does (memlm.distributed.env.ProcessGroup(device, backend): gloo on
    CPU unless named; device="cuda": NCCL, one GPU a rank). `per_node`: ranks per "node"
    (torchrun's LOCAL_WORLD_SIZE; default all of them), e.g. 2 for two nodes of 2 ranks."""
    mp.spawn(_entry, args=(world, free_port(), device, backend, per_node or world, fn, args), nprocs=world,
             join=True)
