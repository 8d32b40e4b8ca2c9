"""Value-table layouts: what each `parallel.memory_parallel` costs a step.

From a few numbers of the config (no model): the bytes one rank sends per
optimizer step for the value tables at each memory_parallel, the seconds on
NVLink or the network, and the layout `parallel.memory_parallel=auto` takes
(memlm.distributed.memory_hooks.resolve_memory_parallel). The scale planner
(memlm.plan) shows the same rows beside the rest of its estimates:

    rows = value_layouts(values, world=64, gpus_per_node=8, tokens=8192)   # values: [ValueTables]
    best = least_traffic(rows)                   # the row with the fewest seconds

A run's tables come as a list of groups of one shape each (a memory kind's
pool or pools, each Engram layer's table): the traffic is their sum, and a
memory_parallel must split every group's width.

Every constant is stated here and in docs/scaling-plan.md; these are
estimates for choosing a layout, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """Datasheet numbers of one GPU (NVIDIA H100/H200 SXM datasheets)."""

    name: str
    peak_bf16_flops: float  # dense bf16 tensor-core FLOP/s (no sparsity)
    hbm_bytes: float  # memory capacity
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s per direction (900 GB/s NVLink 4 total = 450 GB/s each way)
    network_bw: float  # bytes/s per GPU between nodes (one 400 Gb/s NDR NIC per GPU)


GPUS = {
    "H100": GPU("H100", 989e12, 80e9, 3.35e12, 450e9, 50e9),
    "H200": GPU("H200", 989e12, 141e9, 4.8e12, 450e9, 50e9),
}

# Collectives reach 80% of the link bandwidth (docs/scaling-plan.md).
LINK_EFFICIENCY = 0.8
# The read weights (and their partial gradients) travel between
# memory-parallel ranks in float32, whatever the table's dtype (memory/parallel.py).
WEIGHT_BYTES = 4


@dataclass(frozen=True, order=True)
class ValueTables:
    """One group of a run's value tables (equal shapes) and how one step reads them: all the
    value-table traffic of a memory_parallel layout depends on. A read is a bag of
    `reads_per_token` rows per token (Engram's heads are bags of one row each: reads_per_token 1,
    a read per head).
    memlm.distributed.memory_hooks.value_tables reads them from the config, the
    planner from the built model (tests/integration/test_value_layout.py: the same)."""

    tables: int  # separate tables (one pool shared by every memory layer: 1)
    rows: int  # slots of each table (memory.n_keys ** 2)
    v_dim: int
    value_bytes: int  # one table element (memory.value_dtype)
    grad_bytes: int  # one gradient element sent between replicas (memory.value_grad_reduce_dtype)
    reads: int  # memory layers reading a table, per forward
    reads_per_token: int  # heads * knn of one layer
    sparse_updates: bool  # replicas exchange touched rows (memory.sparse_updates), not the whole table


def memory_parallel_candidates(world: int, *v_dims: int) -> list[int]:
    """The memory_parallel sizes a layout can take: powers of two dividing
    the world and every value width (only 1 without value tables: no widths, or 0)."""
    if not v_dims or not all(v_dims):
        return [1]
    return [p for p in (2**i for i in range(world.bit_length()))
            if world % p == 0 and all(v % p == 0 for v in v_dims)]


def touched_rows(rows: int, lookups: float) -> float:
    """Expected distinct rows of a `rows`-row table hit by `lookups` reads
    spread uniformly over it (real reads are skewed: fewer)."""
    if lookups <= 0:
        return 0.0
    return -rows * math.expm1(lookups * math.log1p(-1 / rows)) if rows > 1 else 1.0


def value_traffic(values: list[ValueTables], p: int, world: int, tokens: int,
                  rows_touched: float | None = None) -> dict[str, int]:
    """Bytes one rank sends per optimizer step for the value tables at
    memory_parallel `p` on `world` ranks, `tokens` per rank per step (ring
    algorithms, as counted by tests/helpers/plan_workers.py):

    memory_all_to_all   every read (memory/parallel.py): forward all-gather
                        of (slots int64, weights fp32) and all-to-all of the
                        bag; backward all-to-all of the output gradient and
                        of the partial weight gradients (fp32)
    value_grad_all_reduce  dense gradients: each table slice (rows x v_dim/p,
                        reduce dtype) all-reduced over its world/p replicas
    value_grad_rows     memory.sparse_updates: the replicas all-gather their
                        row count, touched rows (int64) and row gradients,
                        padded to the most rows any replica touched
                        (distributed/value_grads.py). `rows_touched` per table and
                        replica, or the uniform-read expectation (`touched_rows`)
                        of the group's p * tokens tokens
    value_grad          the one of the two the config uses
    Summed over the groups of `values` (`rows_touched`, when given, for each).
    """
    out = dict.fromkeys(("memory_all_to_all", "value_grad_all_reduce", "value_grad_rows", "value_grad"), 0)
    for group in values:
        for key, n in _group_traffic(group, p, world, tokens, rows_touched).items():
            out[key] += n
    return out


def _group_traffic(values: ValueTables, p: int, world: int, tokens: int, rows_touched: float | None) -> dict[str, int]:
    """value_traffic of one group of tables."""
    b, k, vb, gb = tokens, values.reads_per_token, values.value_bytes, values.grad_bytes
    cols = values.v_dim // p
    replicas = world // p
    a2a = 0
    if p > 1:
        per_read = (p - 1) * b * k * (8 + WEIGHT_BYTES)  # all-gather slots + weights
        per_read += 2 * (p - 1) * b * cols * vb  # bag out, its gradient back (the table's dtype)
        per_read += (p - 1) * b * k * WEIGHT_BYTES  # partial weight gradients
        a2a = per_read * values.reads
    # Per table, as each all-reduce is counted (one collective per table).
    all_reduce = values.tables * (2 * (replicas - 1) * values.rows * cols * gb // replicas)
    if rows_touched is None:
        lookups = p * tokens * k * values.reads / values.tables  # the group's reads of one table
        rows_touched = touched_rows(values.rows, lookups)
    rows = round(rows_touched)
    exchange = values.tables * (replicas - 1) * (8 + rows * (8 + cols * gb))
    return {"memory_all_to_all": a2a, "value_grad_all_reduce": all_reduce, "value_grad_rows": exchange,
            "value_grad": exchange if values.sparse_updates else all_reduce}


def spans_nodes(ranks, gpus_per_node: int) -> bool:
    """Whether the ranks (any iterable of global ranks) sit on more than one node."""
    return len({r // gpus_per_node for r in ranks}) > 1


def link_bandwidth(gpu: GPU, spans_nodes: bool) -> float:
    """Bytes/s a collective reaches: NVLink inside a node, the network across."""
    return (gpu.network_bw if spans_nodes else gpu.nvlink_bw) * LINK_EFFICIENCY


def value_layouts(values: list[ValueTables], world: int, gpus_per_node: int, tokens: int) -> list[dict]:
    """Each memory_parallel candidate with its value-table traffic
    (`value_traffic`) and the seconds it adds to a step: the memory
    all-to-alls on NVLink inside a node or over the network when the group
    spans nodes, the value-gradient exchange likewise over the replicas
    (rank 0's groups, as build_meshes lays them out: p consecutive ranks form
    a memory-parallel group, ranks p apart a replica group). The links of
    an H100 and an H200 are the same: no GPU to name."""
    spec = GPUS["H200"]
    out = []
    for p in memory_parallel_candidates(world, *(group.v_dim for group in values)):
        traffic = value_traffic(values, p, world, tokens)
        seconds = (traffic["memory_all_to_all"] / link_bandwidth(spec, spans_nodes(range(p), gpus_per_node))
                   + traffic["value_grad"] / link_bandwidth(spec, spans_nodes(range(0, world, p), gpus_per_node)))
        out.append({"memory_parallel": p, "replicas": world // p, **traffic, "seconds": seconds})
    return out


def least_traffic(layouts: list[dict]) -> dict:
    """The layout whose value-table communication takes the least time (the
    smaller memory_parallel on a tie: fewer ranks in each collective)."""
    return min(layouts, key=lambda row: (row["seconds"], row["memory_parallel"]))
