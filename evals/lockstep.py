"""Matching the ranks' forward passes when they evaluate one sharded model.

A model sharded by FSDP2, or with a memory-parallel value table, runs
collectives inside every forward: each rank must call it as often as every
other rank, or they wait on each other forever. Evaluation gives each rank
its own examples (rank r takes r::world_size, memlm.evals.harness), so their
batch counts and decode lengths differ. The scoring loops, and the decoding
loop the harness hands one to (memlm.generation.decoding.decode's `lock`),
ask one `Lockstep` how many rounds to run and when to stop:

    lock = Lockstep.of(model)
    for i in range(lock.rounds(len(batches))):  # the largest count over the ranks
        if i >= len(batches):
            lock.idle(model)  # a one-token forward: this rank's share of the collectives
            continue
        ...
        if lock.all(all(done)): break  # decoding stops when every rank's rows have

For a model that every rank holds whole (the evals command line, one
process), `Lockstep.of` returns one that never communicates: rounds(n) is n
and all(flag) is flag. The memory-parallel read itself pads the ranks'
token counts to the group's largest in inference (memlm.distributed.memory_parallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from memlm.ranks import many_ranks


class Lockstep:
    def __init__(self, device: torch.device | None = None):
        # device: where the collectives' small tensors live (the model's: NCCL needs CUDA); None: no ranks to match.
        self.device = device

    @classmethod
    def of(cls, model: torch.nn.Module) -> Lockstep:
        """Matching over all ranks when the model is sharded (an FSDP2 module, or
        a DTensor parameter such as a memory-parallel table), else none. FSDP2
        is asked by module: between forwards its root's parameters are plain tensors."""
        params = list(model.parameters())
        sharded = many_ranks() and (
            any(isinstance(m, FSDPModule) for m in model.modules()) or any(isinstance(p, DTensor) for p in params))
        return cls(params[0].device) if sharded else cls()

    @property
    def active(self) -> bool:
        return self.device is not None

    def rounds(self, n: int) -> int:
        """The largest n over the ranks."""
        return int(self._reduce(n, dist.ReduceOp.MAX)) if self.active else n

    def all(self, flag: bool) -> bool:
        """True when the flag is true on every rank."""
        return bool(self._reduce(int(flag), dist.ReduceOp.MIN)) if self.active else flag

    def idle(self, model: torch.nn.Module) -> None:
        """One forward of a single token, its output dropped: the collectives a
        rank with nothing left to evaluate owes the ranks still working."""
        model(torch.zeros(1, 1, dtype=torch.long, device=self.device))

    def _reduce(self, value: int, op) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=op)
        return t.item()
