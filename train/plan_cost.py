"""The cost model of the scale planner: GPU constants, activation memory,
per-step communication volume and step time / MFU.

`memlm.train.plan` builds the real model and parallel layout and reads the
bytes of the sharded tensors; this file turns that layout into estimates:

    layout = Layout(...)                         # filled by memlm.train.plan
    act = activation_bytes(model, layout)        # bytes per rank, one micro-batch
    comm = comm_volume(layout)                   # {kind: bytes sent per rank per step}
    time = step_time(layout, comm, GPUS["H200"]) # seconds, with the parts and the MFU

and the value-table layouts a run can take, from a few numbers of the
config (no model): the bytes and seconds of each memory_parallel, and the
one `parallel.memory_parallel=auto` takes (memlm.train.memory_hooks):

    rows = value_layouts(values, world=64, gpus_per_node=8, tokens=8192)
    best = least_traffic(rows)                   # the row with the fewest seconds

Every constant and assumption is stated here (and in docs/scaling-plan.md);
the numbers are estimates for planning, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from memlm.errors import ConfigError


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

# Assumptions (docs/scaling-plan.md): matmuls reach half the datasheet peak,
# collectives 80% of the link bandwidth, bandwidth-bound kernels 80% of HBM
# bandwidth; 10% of HBM is kept free (CUDA context, NCCL buffers, allocator
# fragmentation) when deciding whether a layout fits.
MATMUL_EFFICIENCY = 0.5
LINK_EFFICIENCY = 0.8
HBM_EFFICIENCY = 0.8
HBM_HEADROOM = 0.9
# The read weights (and their partial gradients) travel between
# memory-parallel ranks in float32, whatever the table's dtype (memory/parallel.py).
WEIGHT_BYTES = 4


def gpu_spec(name: str) -> GPU:
    if name not in GPUS:
        raise ConfigError("--gpu", name, f"one of: {', '.join(GPUS)}")
    return GPUS[name]


@dataclass(frozen=True)
class ValueTables:
    """The value tables of a run and how one step reads them: all the
    value-table traffic of a memory_parallel layout depends on.
    memlm.train.memory_hooks.value_tables reads them from the config, the
    planner from the built model (tests/test_value_layout.py: the same)."""

    tables: int  # separate tables (one pool shared by every memory layer: 1)
    rows: int  # slots of each table (memory.n_keys ** 2)
    v_dim: int
    value_bytes: int  # one table element (memory.value_dtype)
    grad_bytes: int  # one gradient element sent between replicas (memory.value_grad_reduce_dtype)
    reads: int  # memory layers reading a table, per forward
    reads_per_token: int  # heads * knn of one layer
    sparse_updates: bool  # replicas exchange touched rows (memory.sparse_updates), not the whole table


@dataclass
class Layout:
    """What the planner read from the built model and meshes of one rank."""

    world: int
    rank: int
    gpus_per_node: int
    memory_parallel: int
    tokens: int  # tokens per rank per micro-batch (micro_batch * seq_len)
    accum: int  # micro-batches per optimizer step
    seq_len: int
    flops_per_token: int  # forward FLOPs (Transformer.flops_per_token)
    compute_bytes: int  # bytes of one activation element (2 for bf16)
    fsdp_size: int  # ranks one FSDP shard group spans (1: no FSDP)
    fsdp_replicas: int  # hybrid sharding: replicas of each shard (1 for full sharding)
    fsdp_spans_nodes: bool
    # FSDP units: (full parameter bytes in the all-gather dtype, in the
    # reduce dtype, resharded after forward and so gathered again in backward)
    fsdp_units: list[tuple[int, int, bool]] = field(default_factory=list)
    fsdp_local_bytes: int = 0  # this rank's FSDP shards (fp32), for the hybrid all-reduce
    values: ValueTables | None = None  # None: no value tables
    value_local_bytes: int = 0  # this rank's value-table slices (all tables)
    value_replicas: int = 1  # ranks holding the same column slice
    memory_spans_nodes: bool = False
    replicas_span_nodes: bool = False
    dense_local_bytes: int = 0  # this rank's non-value parameters (fp32), for the optimizer pass


# ----------------------------------------------------------------- activations
def _block_bytes_per_token(block: nn.Module, layout: Layout) -> tuple[int, int]:
    """(saved bytes per token of one block, bytes kept when its checkpointed part is recomputed).

    Counted from the code in model/ and memory/: an RMSNorm keeps an fp32 copy
    of its input plus its output; attention keeps its input, q, k, v and the
    SDPA output (flash attention: no seq x seq matrix); SwiGLU keeps its input,
    both projections, silu and their product; a Memory+ layer keeps its
    input, the query, the (slots, weights) of its reads (gathered from the
    whole memory-parallel group), the bag output, the gate and the product."""
    a = layout.compute_bytes
    attn = block.attention
    d = attn.wq.in_features
    q_dim, kv_dim = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    norm = (4 + a) * d
    attention = norm + a * (d + q_dim + 2 * kv_dim + q_dim)
    ffn = block.feed_forward
    memory = getattr(ffn, "memory", None)
    if memory is not None:
        k = memory.lookup.heads * memory.knn
        q = memory.lookup.heads * memory.lookup.k_dim
        reads = layout.memory_parallel * k * (8 + 4)  # int64 slots + weights, group-gathered
        ffn_part = norm + a * (d + q + 4 * memory.v_dim) + reads
        if getattr(ffn, "dense", None) is not None:  # placement=parallel keeps the SwiGLU too
            ffn_part += a * 4 * ffn.dense.w1.out_features
    else:
        if isinstance(getattr(ffn, "w1", None), nn.Linear):  # SwiGLU
            hidden = ffn.w1.out_features
        elif hasattr(ffn, "top_k") and hasattr(ffn, "hidden_dim"):  # MoE: each token's top_k experts
            hidden = ffn.top_k * ffn.hidden_dim
        else:  # PEER and others: a dense-sized guess
            hidden = 4 * d
        ffn_part = norm + a * (d + 4 * hidden)
    return attention + ffn_part, attention


def activation_bytes(model: nn.Module, layout: Layout, checkpoint: str) -> dict[str, int]:
    """Activation memory of one rank for one micro-batch: what the blocks save
    for backward (under activation checkpointing only the block inputs, plus
    one block recomputed at a time), and the largest transient: the logits
    (compute dtype, their fp32 copy and its gradient) or one memory layer's
    sub-key scores (fp32, heads x 2 x n_keys per token)."""
    t, a = layout.tokens, layout.compute_bytes
    saved, recompute = 0, 0
    for block in model.layers:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        full, attention = _block_bytes_per_token(inner, layout)
        wrapped = inner is not block or getattr(inner.attention, "_checkpoint_wrapped_module", None) is not None
        if checkpoint == "none" or not wrapped:
            saved += full * t
        elif inner is not block:  # the whole block is recomputed: keep its input
            saved += a * inner.attention_norm.weight.shape[0] * t
            recompute = max(recompute, full * t)
        else:  # memory block: only the attention is recomputed
            saved += (full - attention) * t + a * inner.attention_norm.weight.shape[0] * t
            recompute = max(recompute, attention * t)
    vocab, dim = model.args.vocab_size, model.args.dim
    logits = t * vocab * (a + 4 + 4)
    scores = 0
    for block in model.layers:
        memory = getattr(getattr(block, "_checkpoint_wrapped_module", block).feed_forward, "memory", None)
        if memory is not None:
            scores = max(scores, t * memory.lookup.heads * 2 * memory.lookup.n_keys * 4)
    return {"saved": saved + t * dim * a, "recompute": recompute, "transient": max(logits, scores)}


# --------------------------------------------------------------- communication
def _ring(group: int) -> float:
    """Share of the full tensor one rank sends in a ring all-gather or reduce-scatter."""
    return (group - 1) / group if group > 1 else 0.0


def comm_volume(layout: Layout) -> dict[str, int]:
    """Bytes one rank sends per optimizer step, by kind (ring algorithms):

    fsdp_all_gather      every FSDP unit in forward, again in backward for the
                         units resharded after forward; every micro-batch
    fsdp_reduce_scatter  the gradients (reduce dtype) once per step
    fsdp_replica_all_reduce  hybrid sharding: the gradient shards all-reduced
                         over the replicas (one per node), once per step
    memory_all_to_all    and value_grad_reduce: `value_traffic`
    """
    s = layout.fsdp_size
    gather = sum(full * (2 if resharded else 1) for full, _, resharded in layout.fsdp_units)
    reduce = sum(full for _, full, _ in layout.fsdp_units)
    out = {
        "fsdp_all_gather": int(_ring(s) * gather * layout.accum),
        "fsdp_reduce_scatter": int(_ring(s) * reduce),
        "fsdp_replica_all_reduce": int(2 * _ring(layout.fsdp_replicas) * layout.fsdp_local_bytes),
        "memory_all_to_all": 0,
        "value_grad_reduce": 0,
    }
    if layout.values is not None:
        traffic = value_traffic(layout.values, layout.memory_parallel, layout.world, layout.tokens * layout.accum)
        out["memory_all_to_all"] = traffic["memory_all_to_all"]
        out["value_grad_reduce"] = traffic["value_grad"]
    return out


# ------------------------------------------------------------ value layouts
def memory_parallel_candidates(world: int, v_dim: int) -> list[int]:
    """The memory_parallel sizes a layout can take: powers of two dividing
    the world and the value width (only 1 without value tables, v_dim 0)."""
    if not v_dim:
        return [1]
    return [p for p in (2**i for i in range(world.bit_length())) if world % p == 0 and v_dim % p == 0]


def touched_rows(rows: int, lookups: float) -> float:
    """Expected distinct rows of a `rows`-row table hit by `lookups` reads
    spread uniformly over it (real reads are skewed: fewer)."""
    if lookups <= 0:
        return 0.0
    return -rows * math.expm1(lookups * math.log1p(-1 / rows)) if rows > 1 else 1.0


def value_traffic(values: ValueTables, p: int, world: int, tokens: int,
                  rows_touched: float | None = None) -> dict[str, int]:
    """Bytes one rank sends per optimizer step for the value tables at
    memory_parallel `p` on `world` ranks, `tokens` per rank per step (ring
    algorithms, as counted by tests/plan_workers.py):

    memory_all_to_all   every read (memory/parallel.py): forward all-gather
                        of (slots int64, weights fp32) and all-to-all of the
                        bag; backward all-to-all of the output gradient and
                        of the partial weight gradients (fp32)
    value_grad_all_reduce  dense gradients: each table slice (rows x v_dim/p,
                        reduce dtype) all-reduced over its world/p replicas
    value_grad_rows     memory.sparse_updates: the replicas all-gather their
                        row count, touched rows (int64) and row gradients,
                        padded to the most rows any replica touched
                        (train/value_grads.py). `rows_touched` per table and
                        replica, or the uniform-read expectation (`touched_rows`)
                        of the group's p * tokens tokens
    value_grad          the one of the two the config uses
    """
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


def _spans_nodes(ranks: range, gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


def _link(gpu: GPU, spans_nodes: bool) -> float:
    """Bytes/s a collective reaches: NVLink inside a node, the network across."""
    return (gpu.network_bw if spans_nodes else gpu.nvlink_bw) * LINK_EFFICIENCY


def value_layouts(values: ValueTables, world: int, gpus_per_node: int, tokens: int) -> list[dict]:
    """Each memory_parallel candidate with its value-table traffic
    (`value_traffic`) and the seconds it adds to a step: the memory
    all-to-alls on NVLink inside a node or over the network when the group
    spans nodes, the value-gradient exchange likewise over the replicas
    (rank 0's groups, as build_meshes lays them out: p consecutive ranks form
    a memory-parallel group, ranks p apart a replica group). The links of
    an H100 and an H200 are the same: no GPU to name."""
    spec = GPUS["H200"]
    out = []
    for p in memory_parallel_candidates(world, values.v_dim):
        traffic = value_traffic(values, p, world, tokens)
        seconds = (traffic["memory_all_to_all"] / _link(spec, _spans_nodes(range(p), gpus_per_node))
                   + traffic["value_grad"] / _link(spec, _spans_nodes(range(0, world, p), gpus_per_node)))
        out.append({"memory_parallel": p, "replicas": world // p, **traffic, "seconds": seconds})
    return out


def least_traffic(layouts: list[dict]) -> dict:
    """The layout whose value-table communication takes the least time (the
    smaller memory_parallel on a tie: fewer ranks in each collective)."""
    return min(layouts, key=lambda row: (row["seconds"], row["memory_parallel"]))


# ------------------------------------------------------------------ step time
def step_time(layout: Layout, comm: dict[str, int], gpu: GPU, checkpoint: str) -> dict[str, float]:
    """Estimated seconds per optimizer step and MFU.

    compute   3 x forward FLOPs (4 x for the recomputed share under full
              checkpointing) at MATMUL_EFFICIENCY x peak
    memory    the value reads are bandwidth-bound: each read moves
              heads*knn rows of v_dim (forward), twice that in backward
    optimizer AdamW reads and writes parameter, gradient and two moments
              (28 bytes per fp32 element) plus zeroing the gradients
    fsdp      overlapped with compute by FSDP's prefetching: max(compute, fsdp)
    memory collectives and the value-gradient exchange run on the critical
              path (blocking in forward/backward, after backward): added
    """
    tokens = layout.tokens * layout.accum
    model_flops = 3 * layout.flops_per_token * tokens
    recompute = {"none": 0.0, "selective": 0.5, "full": 1.0}[checkpoint]
    compute = model_flops * (1 + recompute / 3) / (gpu.peak_bf16_flops * MATMUL_EFFICIENCY)
    hbm = gpu.hbm_bw * HBM_EFFICIENCY
    v = layout.values
    read_bytes = 3 * tokens * v.reads * v.reads_per_token * v.v_dim * v.value_bytes if v else 0
    memory = read_bytes / hbm
    table = 0 if v is None or v.sparse_updates else layout.value_local_bytes
    optimizer = (28 + 4) * (table + layout.dense_local_bytes) / 4 / hbm
    fsdp = (comm["fsdp_all_gather"] + comm["fsdp_reduce_scatter"]) / _link(gpu, layout.fsdp_spans_nodes)
    fsdp += comm["fsdp_replica_all_reduce"] / _link(gpu, layout.world > layout.gpus_per_node)
    mem_comm = comm["memory_all_to_all"] / _link(gpu, layout.memory_spans_nodes)
    value_reduce = comm["value_grad_reduce"] / _link(gpu, layout.replicas_span_nodes)
    total = max(compute, fsdp) + memory + optimizer + mem_comm + value_reduce
    return {"compute_s": compute, "fsdp_comm_s": fsdp, "memory_read_s": memory, "optimizer_s": optimizer,
            "memory_comm_s": mem_comm, "value_reduce_s": value_reduce, "step_s": total,
            "tokens_per_s": tokens / total, "mfu": model_flops / (total * gpu.peak_bf16_flops)}
