"""The trainer's side of the memory layers: the value tables' layout,
sharding them, reducing their gradients, the knn schedule and slot-usage
health.

Everything memory-specific the loop needs goes through these functions, so
dense models pay nothing. The layout, before the meshes are built:

    p = resolve_memory_parallel(cfg, env.world_size, env.local_world_size)  # `auto` -> an integer
    meshes = build_meshes(env, p, cfg.parallel.fsdp)
    if (warning := value_grad_warning(cfg, env.world_size, env.local_world_size)):
        print(f"[train] warning: {warning}")
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch import nn

from memlm.distributed.config import ParallelConfig
from memlm.distributed.env import DistEnv, Meshes, build_meshes
from memlm.distributed.memory_parallel import init_value_tables as _init_pool_tables
from memlm.distributed.memory_parallel import shard_value_pools
from memlm.distributed.value_grads import REDUCE_DTYPES, ValueGradReduction
from memlm.distributed.value_layout import ValueTables, least_traffic, value_layouts
from memlm.memory.config import MemoryConfig
from memlm.memory.tables import value_pools
from memlm.memory.usage import usage_metrics
from memlm.memory.values import VALUE_DTYPES
from memlm.model import ModelArgs
from memlm.model.family import memory_family

# A whole-table all-reduce this large per step (bytes one rank sends) is
# worth a warning at start-up: about 27 ms a step over a 400 Gb/s NIC.
WHOLE_TABLE_WARNING_BYTES = 2**30


class RunSections(Protocol):
    """What these functions read of a run's config (memlm.config.run.Config has it; config/
    sits above distributed/, so the sections are named here rather than the class)."""

    model: ModelArgs
    memory: MemoryConfig
    parallel: ParallelConfig

    def tokens_per_step(self, world: int) -> int: ...


def value_tables(cfg: RunSections) -> list[ValueTables]:
    """The run's value tables and how a step reads them, from the config
    alone (the meshes are built before the model): the memory family's pools,
    then each Engram layer's table (memory.engram); [] without tables."""
    mem = cfg.memory
    fam = memory_family(mem)
    pools = fam.value_pools(mem, cfg.model) if fam is not None else None
    grad_bytes = REDUCE_DTYPES[mem.value_grad_reduce_dtype].itemsize
    out = []
    if pools is not None:
        out.append(ValueTables(
            tables=pools.tables, rows=pools.rows, v_dim=pools.v_dim,
            value_bytes=VALUE_DTYPES[mem.value_dtype].itemsize, grad_bytes=grad_bytes,
            reads=len(mem.resolved_layers(cfg.model.n_layers)), reads_per_token=pools.reads_per_token,
            sparse_updates=mem.sparse_updates,
        ))
    engram = mem.engram
    if engram.layers:  # float32 tables; each head a bag of one row (memlm.memory.engram.EngramTables)
        out.append(ValueTables(
            tables=len(engram.layers), rows=engram.table_rows(cfg.model.vocab_size), v_dim=engram.head_dim,
            value_bytes=4, grad_bytes=grad_bytes, reads=len(engram.layers) * engram.n_heads(),
            reads_per_token=1, sparse_updates=mem.sparse_updates,
        ))
    return sorted(out)  # the order the planner's model_value_tables gives


def tokens_per_rank(cfg: RunSections, world: int) -> int:
    """Tokens one rank trains on per optimizer step (global_batch_tokens
    split over the ranks, or one micro-batch)."""
    return cfg.tokens_per_step(world) // world


def value_layouts_of(cfg: RunSections, world: int, gpus_per_node: int) -> list[dict]:
    """Every memory_parallel this run could take on `world` ranks, with its
    value-table traffic and seconds (memlm.distributed.value_layout.value_layouts);
    [] without value tables."""
    values = value_tables(cfg)
    if not values:
        return []
    return value_layouts(values, world, gpus_per_node, tokens_per_rank(cfg, world))


def resolve_memory_parallel(cfg: RunSections, world: int, gpus_per_node: int) -> int:
    """parallel.memory_parallel as an integer: the one given, or for `auto`
    the layout whose value-table traffic takes the least time on `world`
    ranks (1 on one rank or without value tables). The trainer and the
    planner both take it from here."""
    setting = cfg.parallel.memory_parallel
    if setting != "auto":
        return setting
    layouts = value_layouts_of(cfg, world, gpus_per_node) if world > 1 else []
    return least_traffic(layouts)["memory_parallel"] if layouts else 1


def run_meshes(cfg: RunSections, env: DistEnv, say) -> Meshes:
    """The run's meshes, parallel.memory_parallel resolved (`say`: where the whole-table warning goes)."""
    world, per_node = env.world_size, env.local_world_size
    if warning := value_grad_warning(cfg, world, per_node):
        say(f"[train] warning: {warning}")
    return build_meshes(env, resolve_memory_parallel(cfg, world, per_node), cfg.parallel.fsdp)


def value_grad_warning(cfg: RunSections, world: int, gpus_per_node: int) -> str | None:
    """The start-up warning of a run that all-reduces its whole value table
    every step (memory_parallel 1 on several ranks, dense value gradients)
    at WHOLE_TABLE_WARNING_BYTES or more per rank; None otherwise."""
    layouts = value_layouts_of(cfg, world, gpus_per_node) if world > 1 else []
    if not layouts or cfg.memory.sparse_updates or resolve_memory_parallel(cfg, world, gpus_per_node) != 1:
        return None
    whole = layouts[0]  # memory_parallel 1
    if whole["value_grad"] < WHOLE_TABLE_WARNING_BYTES:
        return None
    values = value_tables(cfg)
    best = least_traffic(layouts)
    tables = " and ".join(f"{v.tables} table{'s' if v.tables > 1 else ''} of {v.rows:,} x {v.v_dim}" for v in values)
    line = (f"parallel.memory_parallel=1 on {world} ranks all-reduces the whole value-table gradient ({tables}) "
            f"every step: {_gib(whole['value_grad'])} sent per rank")
    if best["memory_parallel"] != 1:
        line += (f"; parallel.memory_parallel={best['memory_parallel']} (what auto takes here) sends "
                 f"{_gib(best['value_grad'])} of value gradients and {_gib(best['memory_all_to_all'])} in the "
                 "memory all-to-alls")
    return line + f" (python -m memlm.plan ... --world {world} shows every layout)"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def shard_memory_values(model: nn.Module, meshes: Meshes, env: DistEnv) -> None:
    """Column-shard every value table over the memory-parallel group (a no-op
    on one process). The tables are then left out of FSDP."""
    if meshes.memory is None or not value_pools(model):
        return
    shard_value_pools(model, meshes.memory)


def init_value_tables(model: nn.Module, seed: int) -> None:
    """Draw every value table (or this rank's shard) from `seed` alone: the
    same numbers on every replica, for init=full and init=sharded, on any
    number of ranks (memlm.distributed.memory_parallel.init_value_tables)."""
    _init_pool_tables(value_pools(model), seed)


class _NoReduction:
    def finish(self) -> None:
        pass


def value_grad_reduction(model: nn.Module, meshes: Meshes, env: DistEnv, accum: int, memory: MemoryConfig):
    """What sums the value tables' gradients over replicas; call `.finish()`
    after the last micro-batch's backward, before clipping. The dense
    reduction starts from a hook during that backward (distributed/value_grads.py)."""
    pools = value_pools(model)
    if meshes.memory is None or not pools:
        return _NoReduction()
    return ValueGradReduction(pools, meshes.memory, env.world_size, accum, memory.value_grad_reduce_dtype)


class MemoryStep:
    """The memory family's needs on the training loop's points (memlm.train.extensions): its
    `step_start` (product keys: the knn schedule) before a step, and the value gradients' reduction
    (`reduction`, value_grad_reduction's) once the step's backward is done. Engram's tables in host
    memory add their own component (memlm.run.model.host_row_staging)."""

    def __init__(self, model: nn.Module, memory: MemoryConfig, reduction):
        self.model, self.memory, self.reduction = model, memory, reduction
        self.family = memory_family(memory)

    def step_start(self, step: int) -> None:
        if self.family is not None:
            self.family.step_start(self.model, self.memory, step - 1)  # it counts optimizer steps done

    def after_backward(self) -> None:
        self.reduction.finish()  # started by a hook during the last backward


def health_metrics(model: nn.Module) -> dict[str, float]:
    """Per-layer usage over the window since the last call, merged over ranks.
    A collective when distributed: every rank must call it."""
    if dist.is_initialized():
        return usage_metrics(model, reduce=lambda t: dist.all_reduce(t))
    return usage_metrics(model)
