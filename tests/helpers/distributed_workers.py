"""Run a function on N CPU ranks (gloo) from a test, like torchrun would.

Workers live in this importable module (tests/ is on pytest's pythonpath) so
the rank processes can unpickle them.

The ranks start from a fork server (multiprocessing's "forkserver") that has
imported torch and torch.distributed once: a rank forked from it starts in
about 0.2 s, where a spawned one spent about 1.7 s of CPU importing them
(a 4-rank run: about 6 s before its first line on this project's 2-core
machine, under 1 s from the fork server). The server imports no Triton and no
memlm: Triton decides at import whether to interpret (TRITON_INTERPRET, which
some rank functions set for themselves), so those are imported in the rank as
in a spawned one. The server runs no op, so torch's intra-op thread pool has
not started when it forks (the way torch's DataLoader forks its workers after
importing torch). What a spawned rank would have had from the test process it
still has: the test's environment (set in _entry: the server's own is from
when it started), sys.path and the working directory (multiprocessing sends
both); module state is fresh, as in a spawned process.

    run_ranks(fn, 4, *args)   # fn(rank, *args) on 4 gloo ranks; raises if any rank fails
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

# What the fork server imports before its first fork: the torch that nearly every rank function imports,
# none of which imports Triton (tests/integration/test_run_ranks.py).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor"]
multiprocessing.get_context("forkserver").set_forkserver_preload(FORK_SERVER_PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, device: str, backend: str | None, per_node: int, fn: Callable,
           args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test process's, as a spawned rank would inherit it
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
    mp.start_processes(_entry, args=(world, free_port(), device, backend, per_node or world, fn, args,
                                     dict(os.environ)), nprocs=world, join=True, start_method="forkserver")


def environ_value(rank: int, key: str, out_dir: str) -> None:
    """A rank function: write os.environ[key] as this rank sees it to out_dir/rank{rank}.txt."""
    (Path(out_dir) / f"rank{rank}.txt").write_text(os.environ.get(key, "<unset>"))
