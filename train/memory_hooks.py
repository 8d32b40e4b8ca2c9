"""The trainer's side of the memory layers: sharding the value tables,
reducing their gradients, the knn schedule and slot-usage health.

Everything memory-specific the loop needs goes through these functions, so
dense models pay nothing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memlm.errors import ConfigError
from memlm.memory.parallel import reduce_value_grads as _reduce_pool_grads
from memlm.memory.parallel import shard_value_pools, value_pools
from memlm.memory.schedule import apply_knn_schedule
from memlm.memory.usage import usage_metrics
from memlm.train.distributed import DistEnv, Meshes


def shard_memory_values(model: nn.Module, meshes: Meshes, env: DistEnv) -> None:
    """Column-shard every value table over the memory-parallel group (a no-op
    on one process). The tables are then left out of FSDP."""
    if meshes.memory is None or not value_pools(model):
        return
    if model.memory_config is not None and model.memory_config.sparse_updates:
        raise ConfigError(
            "memory.sparse_updates", True,
            f"false when training on more than one rank (world size {env.world_size}): sparse "
            "gradients of a sharded value table are not implemented yet",
        )
    shard_value_pools(model, meshes.memory)


def reduce_value_grads(model: nn.Module, meshes: Meshes, env: DistEnv) -> None:
    if meshes.memory is None:
        return
    pools = value_pools(model)
    if pools:
        _reduce_pool_grads(pools, meshes.memory, env.world_size)


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
