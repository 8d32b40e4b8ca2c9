"""The trainer's side of the memory layers: sharding the value tables,
reducing their gradients, the knn schedule and slot-usage health.

Everything memory-specific the loop needs goes through these functions, so
dense models pay nothing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memlm.memory.parallel import init_value_tables as _init_pool_tables
from memlm.memory.parallel import shard_value_pools, value_pools
from memlm.memory.schedule import apply_knn_schedule
from memlm.memory.usage import usage_metrics
from memlm.train.distributed import DistEnv, Meshes
from memlm.train.value_grads import ValueGradReduction


def shard_memory_values(model: nn.Module, meshes: Meshes, env: DistEnv) -> None:
    """Column-shard every value table over the memory-parallel group (a no-op
    on one process). The tables are then left out of FSDP."""
    if meshes.memory is None or not value_pools(model):
        return
    shard_value_pools(model, meshes.memory)


def init_value_tables(model: nn.Module, seed: int) -> None:
    """Draw every value table (or this rank's shard) from `seed` alone: the
    same numbers on every replica, for init=full and init=sharded, on any
    number of ranks (memlm.memory.parallel.init_value_tables)."""
    _init_pool_tables(value_pools(model), seed)


class _NoReduction:
    def finish(self) -> None:
        pass


def value_grad_reduction(model: nn.Module, meshes: Meshes, env: DistEnv, accum: int, cfg: Any):
    """What sums the value tables' gradients over replicas; call `.finish()`
    after the last micro-batch's backward, before clipping. The dense
    reduction starts from a hook during that backward (train/value_grads.py)."""
    pools = value_pools(model)
    if meshes.memory is None or not pools:
        return _NoReduction()
    return ValueGradReduction(pools, meshes.memory, env.world_size, accum, cfg.memory.value_grad_reduce_dtype)


def on_step_start(model: nn.Module, step: int, cfg: Any) -> None:
    if cfg.memory.kind != "none":
        apply_knn_schedule(model, cfg.memory, step)


def health_metrics(model: nn.Module) -> dict[str, float]:
    """Per-layer usage over the window since the last call, merged over ranks.
    A collective when distributed: every rank must call it."""
    if dist.is_initialized():
        return usage_metrics(model, reduce=lambda t: dist.all_reduce(t))
    return usage_metrics(model)


def value_table_params(model: nn.Module) -> list[torch.Tensor]:
    return [pool.weight for pool in value_pools(model)]
