"""Scale planner: memory, communication and step time of a run on N GPUs,
computed on one CPU without data or a GPU.

    python -m memlm.plan model=8b memory=memplus memory.n_keys=1024 --world 64  # memory_parallel auto
    python -m memlm.plan model=8b memory=memplus memory.n_keys=4096 \\
        parallel.memory_parallel=64 --world 64 --gpu H200       # at the 8b preset's shape, 8192 x 1
    python -m memlm.plan model=8b data.seq_len=4096 --world 8   # an explicit shape wins
    python -m memlm.plan model=1b memory=memplus --world 64 --fit   # the layouts that fit, fastest first
    python -m memlm.plan --paper                                     # docs/scaling-plan.md tables

A model preset is planned at the sequence length and micro-batch it is meant
to train with (TRAINING_SHAPES below, with the reason for each), not at the
data config's CPU-sized default; data.seq_len=... / data.micro_batch=... (or
an experiment=... preset) win over it. The plan says which shape it used and
where each number came from.

It joins a fake process group of N ranks (torch's "fake" backend: collectives
do nothing), then builds the model exactly as the trainer does: the
Transformer on the meta device, the meshes (`build_meshes`), the value
tables column-sharded (`shard_memory_values`), activation checkpointing and
FSDP2 (`apply_fsdp`), and the trainer's optimizer (`build_optimizer`), which
takes one step on meta gradients shaped like the parameters (what the
backward leaves) so its state tensors exist. Parameter, gradient and
optimizer-state bytes are read from those sharded tensors (local shards,
value tables included); activations, communication and step time are
estimates from `memlm.plan.cost`. `parallel.memory_parallel=auto` is
resolved as the trainer resolves it (`memory_hooks.resolve_memory_parallel`),
and a plan on several ranks of a model with value tables ends with every
memory_parallel the run could take: the bytes of its memory all-to-alls and
of its value-gradient exchange (all-reduce, or touched rows under
memory.sparse_updates) per step, the seconds they add, and which one auto takes.

`--fit` plans every power-of-two memory_parallel and, unless the overrides
set them, both parallel.fsdp modes (hybrid only on more than one node) and
the least activation checkpointing that fits (none, then selective, then
full); it ends with one table of the layouts that fit, fastest first, and the
overrides of the fastest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from memlm.config.run import Config, compose
from memlm.distributed.env import DistEnv, build_meshes
from memlm.distributed.memory_hooks import (
    resolve_memory_parallel,
    shard_memory_values,
    value_layouts_of,
)
from memlm.distributed.parallelize import apply_activation_checkpointing, apply_fsdp
from memlm.distributed.precision import compute_dtype
from memlm.distributed.value_grads import REDUCE_DTYPES
from memlm.distributed.value_layout import (
    GPUS,
    ValueTables,
    spans_nodes,
)
from memlm.errors import ConfigError
from memlm.memory.tables import value_pools
from memlm.model import Transformer
from memlm.optim.build import build_optimizer
from memlm.plan.cost import HBM_HEADROOM, Layout, activation_bytes, comm_volume, gpu_spec, step_time
from memlm.plan.table_traffic import expected_rows, host_table_bytes, step_table_bytes

# The shape each model preset is meant to train with: (sequence length,
# micro-batch = sequences per GPU per forward, why). The planner's default for
# that preset: configs/data/ presets carry a CPU-sized 128 tokens, at which an
# 8B model plans at a meaningless MFU. data.seq_len= / data.micro_batch= (or an
# experiment= preset) win. The trainer does not read this table: train at the
# planned shape with the overrides the plan prints.
TRAINING_SHAPES: dict[str, tuple[int, int, str]] = {
    "tiny": (128, 8, "the CPU demo's, configs/experiment/demo.yaml"),
    "134m": (4096, 8, "4,096 tokens, the preset's max_seq_len; 8 sequences keep activations and logits "
                      "near 20 GiB per GPU without activation checkpointing"),
    "373m": (4096, 4, "4,096 tokens, the preset's max_seq_len; 4 sequences keep activations and logits "
                      "near 20 GiB per GPU without activation checkpointing"),
    "1b": (4096, 2, "4,096 tokens, the preset's max_seq_len; 2 sequences keep activations and logits "
                    "near 20 GiB per GPU without activation checkpointing; the --paper table's 1.3B rows "
                    "use the same"),
    "8b": (8192, 1, "8,192 tokens, Llama 3 8B's pretraining sequence length and the preset's max_seq_len; "
                    "one sequence per GPU"),
}
SHAPE_KEYS = {"seq_len": "data.seq_len", "micro_batch": "data.micro_batch"}
TABLE = "TRAINING_SHAPES (memlm/plan/planner.py)"

# The settings of the memory-layer paper (Berges et al., "Memory Layers at
# Scale", 2024): 1.3B base (the 1b preset) with 1M and 64M slots, 8B with 1M
# and 16M slots.
PAPER = [
    ("1.3B + 1M", ["model=1b", "memory=memplus", "memory.n_keys=1024", "data.micro_batch=2"]),
    ("1.3B + 64M", ["model=1b", "memory=memplus", "memory.n_keys=8192", "data.micro_batch=2"]),
    ("8B + 1M", ["model=8b", "memory=memplus", "memory.n_keys=1024", "data.micro_batch=1",
                 "parallel.activation_checkpoint=full"]),
    ("8B + 16M", ["model=8b", "memory=memplus", "memory.n_keys=4096", "data.micro_batch=1",
                  "parallel.activation_checkpoint=full"]),
]
PAPER_COMMON = ["data.seq_len=4096", "memory.spread=3"]
PAPER_WORLDS = (8, 64, 512)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (a DTensor's local shard)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


@contextlib.contextmanager
def fake_process_group(world: int, rank: int) -> Iterator[None]:
    """A process group of `world` ranks whose collectives do nothing, as rank `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner needs its own (fake) process group; one is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_args(cfg: Config, world: int, rank: int, gpus_per_node: int, gpu: str) -> None:
    if world < 1:
        raise ConfigError("--world", world, "an integer >= 1 (the number of GPUs)")
    if not 0 <= rank < world:
        raise ConfigError("--rank", rank, f"an integer in [0, {world - 1}] (--world {world})")
    if gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", gpus_per_node, "an integer >= 1")
    gpu_spec(gpu)
    if cfg.memory.engram.layers and cfg.memory.engram.tables_in == "host" and world > 1:
        raise ConfigError("--world", world, "1 with memory.engram.tables_in=host (a host table is trained by one "
                          "process), or memory.engram.tables_in=device on several GPUs")
    p = cfg.parallel.memory_parallel
    if p != "auto" and world % p:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError("parallel.memory_parallel", p,
                          f"a divisor of --world {world}: one of {', '.join(map(str, divisors))}")


def _fsdp_units(model: torch.nn.Module, gather_dtype: torch.dtype, skip: set[int]) -> list[tuple[int, int, bool]]:
    """(all-gather bytes, reduce bytes, resharded after forward) per FSDP unit:
    each fully_shard module's own parameters (not those of nested units)."""
    units = []
    nested: set[int] = set()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in reversed(modules):  # innermost first
        own = [p for p in module.parameters() if id(p) not in nested and id(p) not in skip]
        nested.update(id(p) for p in own)
        # FSDP2 pads the sharded dim of every parameter to a multiple of the shard group.
        numel = sum(_padded_numel(p) for p in own)
        # apply_fsdp keeps the root unsharded after forward; blocks reshard.
        units.append((numel * gather_dtype.itemsize, numel * 4, module is not model))
    return units


def _padded_numel(p: torch.Tensor) -> int:
    if not isinstance(p, DTensor):
        return p.numel()
    mesh = p.device_mesh
    shards = mesh.size(mesh.ndim - 1)  # the "shard" dimension (hybrid: the last)
    placement = p.placements[-1]
    dim = placement.dim if placement.is_shard() else 0  # apply_fsdp may shard another dim than 0
    size = p.shape[dim]
    padded = -(-size // shards) * shards
    return padded * (p.numel() // size) if size else 0


def override_keys(overrides: list[str]) -> dict[str, str]:
    """{key: override} of the key=value overrides (`+`, `++`, `~` prefixes dropped)."""
    keys = {}
    for override in overrides:
        key, eq, _ = override.partition("=")
        if eq:
            keys[key.lstrip("+~")] = override
    return keys


def planning_config(overrides: list[str]) -> tuple[Config, dict[str, Any]]:
    """The config to plan and its shape: `overrides` composed, with the model
    preset's training shape (TRAINING_SHAPES) for data.seq_len and
    data.micro_batch unless an override or an experiment preset sets them.
    The shape dict says where each number came from, and which overrides the
    trainer needs to run at it (its own default is the data config's)."""
    cfg = compose(overrides)
    given = override_keys(overrides)
    preset = TRAINING_SHAPES.get(cfg.model.name)
    origin: dict[str, str] = {}
    to_train: list[str] = []
    for index, (field, key) in enumerate(SHAPE_KEYS.items()):
        if key in given:
            origin[field] = f"your override {given[key]}"
        elif "experiment" in given:
            origin[field] = f"set by {given['experiment']}"
        elif preset is None:
            origin[field] = (f"configs/data/{cfg.data.name}.yaml: no training shape for model {cfg.model.name!r} "
                             f"in {TABLE}, which has {', '.join(TRAINING_SHAPES)}")
        else:
            value = preset[index]
            origin[field] = f"the {cfg.model.name} preset's training shape in {TABLE}: {preset[2]}"
            if field == "seq_len" and value > cfg.model.max_seq_len:
                value = cfg.model.max_seq_len
                origin[field] = (f"the {cfg.model.name} preset's training shape in {TABLE}, {preset[0]}, capped at "
                                 f"model.max_seq_len={value}")
            setattr(cfg.data, field, value)
            to_train.append(f"{key}={value}")
    if to_train:
        cfg.validate()
    return cfg, {"seq_len": cfg.data.seq_len, "micro_batch": cfg.data.micro_batch, "from": origin,
                 "train_with": to_train}


def plan(cfg: Config, world: int, rank: int = 0, gpu: str = "H200", gpus_per_node: int = 8,
         shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the run's model and layout as rank `rank` of `world` and return
    its plan. `shape`: where data.seq_len and data.micro_batch came from
    (`planning_config`); without it, "the config"."""
    check_args(cfg, world, rank, gpus_per_node, gpu)
    accum = cfg.accumulation_steps(world)
    env = DistEnv(rank, world, rank % gpus_per_node, min(world, gpus_per_node), torch.device("cpu"))
    memory_parallel = resolve_memory_parallel(cfg, world, env.local_world_size)
    # Even one rank joins a (1-rank) fake group: the layout code may build a 1-rank mesh.
    with fake_process_group(world, rank):
        target = torch.device("cuda")  # the precision policy of a GPU run
        meshes = build_meshes(env, memory_parallel, cfg.parallel.fsdp)
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.memory)
        shard_memory_values(model, meshes, env)
        apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint)
        apply_fsdp(model, meshes, cfg.parallel, target)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)  # the backward leaves a gradient shaped like its parameter
        optimizer = build_optimizer(model, cfg, target)  # memlm's optimizers make their state here
        bytes_ = {
            "params": sum(local_bytes(p) for p in model.parameters()),
            "grads": sum(local_bytes(p.grad) for p in params),
            "optimizer": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor)),
        }
        tables = [pool.weight for pool in value_pools(model)]
        table_ids = {id(t) for t in tables}
        engram_tables = {id(b.engram.tables.weight) for b in model.layers if b.engram is not None}
        layout = _layout(cfg, model, meshes, env, accum, memory_parallel, tables, table_ids, target)
        host = _host_tables(cfg, model, optimizer, layout)
        for key in ("params", "grads", "optimizer"):
            bytes_[key] -= host["bytes"].get(key, 0)  # what memory.engram.tables_in=host keeps off the device
        tables = [t for t in tables if not host["bytes"] or id(t) not in engram_tables]
    act = activation_bytes(model, layout, cfg.parallel.activation_checkpoint)
    comm = comm_volume(layout)
    timing = step_time(layout, comm, gpu_spec(gpu), cfg.parallel.activation_checkpoint)
    state = bytes_["params"] + bytes_["grads"] + bytes_["optimizer"]
    total = state + act["saved"] + act["recompute"] + act["transient"]
    counts = model.num_params()
    return {
        "world": world, "rank": rank, "gpu": gpu, "memory_parallel": memory_parallel,
        "memory_parallel_setting": cfg.parallel.memory_parallel, "fsdp": cfg.parallel.fsdp,
        "activation_checkpoint": cfg.parallel.activation_checkpoint,
        "shape": shape or {"seq_len": cfg.data.seq_len, "micro_batch": cfg.data.micro_batch,
                           "from": {"seq_len": "the config", "micro_batch": "the config"}, "train_with": []},
        "model": cfg.model.name, "memory_kind": cfg.memory.kind, "engram_layers": sorted(cfg.memory.engram.layers),
        "memory_sparse_updates": cfg.memory.sparse_updates,
        # the memory kind's value-table rows (0 without memory layers), not Engram's n-gram rows
        "slots": sum(t.shape[0] for t in tables if id(t) not in engram_tables),
        "params_total": counts["total"], "params_active": counts["active"],
        "params_memory": counts["memory"],  # every sparse table (memlm.memory.tables), pools or not
        "bytes": {**bytes_, "value_tables": sum(local_bytes(t) for t in tables),
                  "activations": act, "total": total},
        "fits": total <= GPUS[gpu].hbm_bytes * HBM_HEADROOM,
        "comm_bytes": comm, "time": timing,
        # Each memory_parallel the run could take, with its value-table traffic (gpus_per_node as
        # env.local_world_size: the trainer's view); auto takes the one of least seconds.
        "value_layouts": value_layouts_of(cfg, world, env.local_world_size),
        "tokens_per_step": layout.tokens * layout.accum * world,
        "table_step_bytes": _table_step_bytes(layout),
        "host_tables": host,
    }


def _host_tables(cfg: Config, model, optimizer, layout: Layout) -> dict[str, Any]:
    """Engram's tables in host memory (memory.engram.tables_in=host): their bytes there (the table, a
    gradient's worth for its rows, the AdamW moments) and what a step moves between host and device;
    {"bytes": {}} with the tables on the device."""
    engrams = [b.engram for b in model.layers if b.engram is not None]
    if cfg.memory.engram.tables_in != "host" or not engrams:
        return {"bytes": {}}
    weights = [e.tables.weight for e in engrams]
    held = {
        "params": sum(local_bytes(w) for w in weights),
        "grads": sum(local_bytes(w.grad) for w in weights if w.grad is not None),
        "optimizer": sum(local_bytes(v) for w in weights for v in optimizer.state.get(w, {}).values()
                         if isinstance(v, torch.Tensor)),
    }
    head_rows = list(engrams[0].hash.head_rows)
    step = host_table_bytes(layout.tokens, head_rows, engrams[0].head_dim, len(engrams), layout.accum)
    return {"bytes": held, "step": step}


def _table_step_bytes(layout: Layout) -> dict[str, int]:
    """This rank's value-table traffic per optimizer step (plan/table_traffic.py),
    for its columns of the tables, reads spread evenly over the rows."""
    out: dict[str, int] = {}
    for v in layout.values:
        if v.sparse_updates:
            return {}
        cols = v.v_dim // layout.memory_parallel
        # Each micro-batch's reads of a layer: the memory-parallel group's tokens (memory/... reads them all).
        reads = layout.tokens * layout.memory_parallel * v.reads_per_token
        per_table = step_table_bytes(v.rows, cols, v.value_bytes, v.reads * layout.accum // v.tables,
                                     expected_rows(reads, v.rows))
        for k, n in per_table.items():
            out[k] = out.get(k, 0) + n * v.tables
    return out


def _layout(cfg: Config, model, meshes, env: DistEnv, accum: int, memory_parallel: int, tables, table_ids,
            target) -> Layout:
    world, gpn = env.world_size, env.local_world_size
    layout = Layout(
        world=world, rank=env.rank, gpus_per_node=gpn, memory_parallel=memory_parallel,
        tokens=cfg.micro_batch_tokens(1), accum=accum, seq_len=cfg.data.seq_len,
        flops_per_token=model.flops_per_token(cfg.data.seq_len),
        compute_bytes=compute_dtype(cfg.parallel, target).itemsize,
        fsdp_size=1, fsdp_replicas=1, fsdp_spans_nodes=False,
        values=model_value_tables(model, cfg), value_local_bytes=sum(local_bytes(t) for t in tables),
        dense_local_bytes=sum(local_bytes(p) for p in model.parameters() if id(p) not in table_ids),
    )
    if meshes.fsdp is not None:
        mesh = meshes.fsdp
        shard = mesh["shard"] if mesh.ndim == 2 else mesh
        layout.fsdp_size = shard.size()
        layout.fsdp_replicas = mesh.size(0) if mesh.ndim == 2 else 1
        layout.fsdp_spans_nodes = spans_nodes(shard.mesh.flatten().tolist(), gpn)
        gather = compute_dtype(cfg.parallel, target)
        layout.fsdp_units = _fsdp_units(model, gather, table_ids)
        layout.fsdp_local_bytes = layout.dense_local_bytes
    if meshes.memory is not None:
        grid = meshes.memory.mesh  # (replicas, memory_parallel) rank ids
        row = next(r for r in grid.tolist() if env.rank in r)
        col = grid[:, row.index(env.rank)].tolist()
        layout.value_replicas = len(col)
        layout.memory_spans_nodes = spans_nodes(row, gpn)
        layout.replicas_span_nodes = spans_nodes(col, gpn)
    return layout


def model_value_tables(model: torch.nn.Module, cfg: Config) -> list[ValueTables]:
    """The value tables of a built model and how a step reads them, read from
    its modules (what `memory_hooks.value_tables` derives from the config): the pools
    grouped by shape, each with its reading layers and the rows a read takes per token
    (ValuePool.add_reader); [] without pools."""
    groups: dict[tuple, list] = {}
    for pool in value_pools(model):
        w = pool.weight
        groups.setdefault((w.shape[0], w.shape[1], w.element_size(), pool.reads_per_token // pool.layers),
                          []).append(pool)
    grad_bytes = REDUCE_DTYPES[cfg.memory.value_grad_reduce_dtype].itemsize
    return sorted(ValueTables(tables=len(pools), rows=rows, v_dim=v_dim, value_bytes=value_bytes, grad_bytes=grad_bytes,
                        reads=sum(pool.layers for pool in pools), reads_per_token=per_read,
                        sparse_updates=cfg.memory.sparse_updates)
            for (rows, v_dim, value_bytes, per_read), pools in groups.items())
