"""Scale planner: memory, communication and step time of a run on N GPUs,
computed on one CPU without data or a GPU.

    python -m memlm.train.plan model=8b memory=memplus memory.n_keys=4096 \\
        parallel.memory_parallel=64 data.seq_len=4096 data.micro_batch=1 --world 64 --gpu H200
    python -m memlm.train.plan model=1b memory=memplus --world 64 --fit   # which memory_parallel fits
    python -m memlm.train.plan --paper                                     # docs/scaling-plan.md tables

It joins a fake process group of N ranks (torch's "fake" backend: collectives
do nothing), then builds the model exactly as the trainer does: the
Transformer on the meta device, the meshes (`build_meshes`), the value
tables column-sharded (`shard_memory_values`), activation checkpointing and
FSDP2 (`apply_fsdp`), and the trainer's optimizer (`build_optimizer`), which
takes one step on meta gradients shaped like the parameters (what the
backward leaves) so its state tensors exist. Parameter, gradient and
optimizer-state bytes are read from those sharded tensors (local shards,
value tables included); activations, communication and step time are
estimates from `memlm.train.plan_cost`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from memlm.errors import ConfigError
from memlm.memory.parallel import value_pools
from memlm.model import Transformer
from memlm.train.config import Config, compose
from memlm.train.distributed import DistEnv, build_meshes
from memlm.train.memory_hooks import shard_memory_values
from memlm.train.optim import build_optimizer
from memlm.train.parallelize import apply_activation_checkpointing, apply_fsdp
from memlm.train.plan_cost import (
    GPUS,
    HBM_HEADROOM,
    Layout,
    activation_bytes,
    comm_volume,
    gpu_spec,
    step_time,
)
from memlm.train.precision import compute_dtype
from memlm.train.trainer import accumulation_steps

GiB = 2**30
# The paper's settings (MEMORY_LAYERS.md section 4): 1.3B base (the 1b preset)
# with 1M and 64M slots, 8B with 1M and 16M slots.
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
    p = cfg.parallel.memory_parallel
    if world % p:
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


def _spans_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


def plan(cfg: Config, world: int, rank: int = 0, gpu: str = "H200", gpus_per_node: int = 8) -> dict[str, Any]:
    """Build the run's model and layout as rank `rank` of `world` and return its plan."""
    check_args(cfg, world, rank, gpus_per_node, gpu)
    accum = accumulation_steps(cfg, world)
    # Even one rank joins a (1-rank) fake group: the layout code may build a 1-rank mesh.
    with fake_process_group(world, rank):
        target = torch.device("cuda")  # the precision policy of a GPU run
        env = DistEnv(rank, world, rank % gpus_per_node, min(world, gpus_per_node), torch.device("cpu"))
        meshes = build_meshes(env, cfg.parallel.memory_parallel, cfg.parallel.fsdp)
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.memory)
        shard_memory_values(model, meshes, env)
        apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint)
        apply_fsdp(model, meshes, cfg.parallel, target)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)  # the backward leaves a gradient shaped like its parameter
        optimizer = build_optimizer(model, cfg, target)
        for group in optimizer.param_groups:
            # The fused kernel has no meta implementation; the foreach path
            # creates the same state (its step counters live on the host,
            # the fused kernel's on the device: 4 bytes per tensor either way).
            if group.get("fused"):
                group["fused"] = False
        optimizer.step()
        bytes_ = {
            "params": sum(local_bytes(p) for p in model.parameters()),
            "grads": sum(local_bytes(p.grad) for p in params),
            "optimizer": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor)),
        }
        tables = [pool.weight for pool in value_pools(model)]
        table_ids = {id(t) for t in tables}
        layout = _layout(cfg, model, meshes, env, accum, tables, table_ids, target)
    act = activation_bytes(model, layout, cfg.parallel.activation_checkpoint)
    comm = comm_volume(layout)
    timing = step_time(layout, comm, gpu_spec(gpu), cfg.parallel.activation_checkpoint)
    state = bytes_["params"] + bytes_["grads"] + bytes_["optimizer"]
    total = state + act["saved"] + act["recompute"] + act["transient"]
    counts = model.num_params()
    return {
        "world": world, "rank": rank, "gpu": gpu, "memory_parallel": cfg.parallel.memory_parallel,
        "model": cfg.model.name, "memory_kind": cfg.memory.kind,
        "slots": sum(t.shape[0] for t in tables),  # value-table rows (0 without memory layers)
        "params_total": counts["total"], "params_active": counts["active"],
        "bytes": {**bytes_, "value_tables": sum(local_bytes(t) for t in tables),
                  "activations": act, "total": total},
        "fits": total <= GPUS[gpu].hbm_bytes * HBM_HEADROOM,
        "comm_bytes": comm, "time": timing,
        "tokens_per_step": layout.tokens * layout.accum * world,
    }


def _layout(cfg: Config, model, meshes, env: DistEnv, accum: int, tables, table_ids, target) -> Layout:
    from memlm.memory.layers import ProductKeyMemory

    world, gpn = env.world_size, env.local_world_size
    reads = [m for m in model.modules() if isinstance(m, ProductKeyMemory)]
    layout = Layout(
        world=world, rank=env.rank, gpus_per_node=gpn, memory_parallel=cfg.parallel.memory_parallel,
        tokens=cfg.data.micro_batch * cfg.data.seq_len, accum=accum, seq_len=cfg.data.seq_len,
        flops_per_token=model.flops_per_token(cfg.data.seq_len),
        compute_bytes=compute_dtype(cfg.parallel, target).itemsize,
        fsdp_size=1, fsdp_replicas=1, fsdp_spans_nodes=False,
        memory_reads=len(reads), reads_per_token=(reads[0].lookup.heads * reads[0].knn) if reads else 0,
        v_dim=tables[0].shape[1] if tables else 0, value_bytes=tables[0].element_size() if tables else 0,
        value_local_bytes=sum(local_bytes(t) for t in tables), sparse_updates=cfg.memory.sparse_updates,
        dense_local_bytes=sum(local_bytes(p) for p in model.parameters() if id(p) not in table_ids),
    )
    if meshes.fsdp is not None:
        mesh = meshes.fsdp
        shard = mesh["shard"] if mesh.ndim == 2 else mesh
        layout.fsdp_size = shard.size()
        layout.fsdp_replicas = mesh.size(0) if mesh.ndim == 2 else 1
        layout.fsdp_spans_nodes = _spans_nodes(shard.mesh.flatten().tolist(), gpn)
        gather = compute_dtype(cfg.parallel, target)
        layout.fsdp_units = _fsdp_units(model, gather, table_ids)
        layout.fsdp_local_bytes = layout.dense_local_bytes
    if meshes.memory is not None:
        grid = meshes.memory.mesh  # (replicas, memory_parallel) rank ids
        row = next(r for r in grid.tolist() if env.rank in r)
        col = grid[:, row.index(env.rank)].tolist()
        layout.value_replicas = len(col)
        layout.memory_spans_nodes = _spans_nodes(row, gpn)
        layout.replicas_span_nodes = _spans_nodes(col, gpn)
    return layout


# ------------------------------------------------------------------- output
def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _size(n: float) -> str:
    """`12.34 GiB (13,249,999,872 B)`: readable, and the exact count."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:8.2f} {unit} ({int(n):,} B)"
    return f"{int(n):8d} B"


def format_plan(p: dict[str, Any]) -> str:
    b, t, c = p["bytes"], p["time"], p["comm_bytes"]
    act = b["activations"]
    lines = [
        f"plan: {p['model']} + {p['memory_kind']} ({p['slots']:,} slots), {p['params_total']:,} params "
        f"({p['params_active']:,} active), {p['world']} x {p['gpu']}, memory_parallel {p['memory_parallel']}, "
        f"rank {p['rank']}, {p['tokens_per_step']:,} tokens/step",
        "per rank, read from the sharded tensors:",
        f"  parameters        {_size(b['params'])}, value tables {_size(b['value_tables']).strip()}",
        f"  gradients         {_size(b['grads'])}",
        f"  optimizer state   {_size(b['optimizer'])}",
        "per rank, estimated:",
        f"  activations       {_size(act['saved'] + act['recompute'])}, transient peak "
        f"{_size(act['transient']).strip()}",
        f"  total             {_size(b['total'])} of {_gib(GPUS[p['gpu']].hbm_bytes)} GiB: "
        f"{'fits' if p['fits'] else 'does NOT fit'} (keeping {1 - HBM_HEADROOM:.0%} free)",
        "communication per optimizer step, sent by one rank:",
        *(f"  {kind:<20}{_size(v)}" for kind, v in c.items()),
        f"estimated step time on {p['gpu']} (s):",
        f"  compute {t['compute_s']:.4f}, fsdp comm {t['fsdp_comm_s']:.4f} (overlapped with compute), "
        f"memory read {t['memory_read_s']:.4f}, optimizer {t['optimizer_s']:.4f}, memory comm "
        f"{t['memory_comm_s']:.4f}, value reduce {t['value_reduce_s']:.4f}",
        f"  step {t['step_s']:.4f} s, {t['tokens_per_s']:,.0f} tokens/s per GPU, MFU {t['mfu']:.1%}",
    ]
    return "\n".join(lines)


def fit_candidates(cfg: Config, world: int) -> list[int]:
    """memory_parallel values to try: powers of two dividing the world and the value width."""
    v_dim = cfg.memory.v_dim or cfg.model.dim
    return [p for p in (2**i for i in range(20)) if p <= world and world % p == 0 and v_dim % p == 0]


def fit(overrides: list[str], world: int, gpu: str, gpus_per_node: int) -> list[dict[str, Any]]:
    """One plan per candidate memory_parallel, smallest first."""
    base = compose(overrides)
    return [plan(compose([*overrides, f"parallel.memory_parallel={p}"]), world, 0, gpu, gpus_per_node)
            for p in fit_candidates(base, world)]


def paper_table(gpu: str, gpus_per_node: int, extra: list[str] = ()) -> str:
    """The docs/scaling-plan.md table: each paper setting on 8, 64 and 512 GPUs.
    Memory columns at the smallest memory_parallel that fits (or the largest
    tried); every power-of-two memory_parallel that fits; the fastest of them."""
    rows = ["| setting | GPUs | smallest P that fits | params | grads | optimizer | activations | total | "
            "memory_parallel that fit | fastest P | step s | MFU |", "|" + "---|" * 12]
    for name, overrides in PAPER:
        for world in PAPER_WORLDS:
            plans = fit([*PAPER_COMMON, *overrides, *extra], world, gpu, gpus_per_node)
            fitting = [p for p in plans if p["fits"]]
            p = fitting[0] if fitting else plans[-1]
            fast = min(fitting or plans, key=lambda q: q["time"]["step_s"])
            b, act = p["bytes"], p["bytes"]["activations"]
            fit_list = ", ".join(str(q["memory_parallel"]) for q in fitting) or "none"
            rows.append(
                f"| {name} | {world} | {p['memory_parallel'] if fitting else 'none'} | {_gib(b['params'])} | "
                f"{_gib(b['grads'])} | {_gib(b['optimizer'])} | "
                f"{_gib(act['saved'] + act['recompute'] + act['transient'])} | "
                f"{_gib(b['total'])}{'' if fitting else ' (P=' + str(p['memory_parallel']) + ')'} | {fit_list} | "
                f"{fast['memory_parallel'] if fitting else '-'} | {fast['time']['step_s']:.2f} | "
                f"{fast['time']['mfu']:.1%} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.train.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8, help="number of GPUs (ranks)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to plan (0 holds the largest FSDP shards)")
    parser.add_argument("--gpu", default="H200", help=f"one of: {', '.join(GPUS)}")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--fit", action="store_true", help="try every power-of-two memory_parallel")
    parser.add_argument("--paper", action="store_true",
                        help="the docs/scaling-plan.md table (overrides apply to every setting)")
    parser.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=8b memory=memplus")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    try:
        gpu_spec(args.gpu)
        if args.paper:
            print(paper_table(args.gpu, args.gpus_per_node, args.overrides))
            return 0
        if args.fit:
            plans = fit(args.overrides, args.world, args.gpu, args.gpus_per_node)
        else:
            plans = [plan(compose(args.overrides), args.world, args.rank, args.gpu, args.gpus_per_node)]
    except ConfigError as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plans, indent=2))
        return 0
    for p in plans:
        print(format_plan(p) + "\n")
    if args.fit:
        fitting = [p["memory_parallel"] for p in plans if p["fits"]]
        print(f"memory_parallel that fits on {args.world} x {args.gpu}: "
              f"{', '.join(map(str, fitting)) if fitting else 'none of ' + str([p['memory_parallel'] for p in plans])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
