"""The cost model of the scale planner: GPU constants, activation memory,
per-step communication volume and step time / MFU.

`memlm.plan.planner` builds the real model and parallel layout and reads the
bytes of the sharded tensors; this file turns that layout into estimates:

    layout = Layout(...)                         # filled by memlm.plan.planner
    act = activation_bytes(model, layout)        # bytes per rank, one micro-batch
    comm = comm_volume(layout)                   # {kind: bytes sent per rank per step}
    time = step_time(layout, comm, GPUS["H200"]) # seconds, with the parts and the MFU

The value-table traffic of each memory_parallel, which the trainer also
needs to resolve `parallel.memory_parallel=auto`, lives with the distributed
code (memlm.distributed.value_layout) and is imported here.

Every constant and assumption is stated here (and in docs/scaling-plan.md);
the numbers are estimates for planning, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from memlm.distributed.value_layout import GPU, GPUS, ValueTables, link_bandwidth, value_traffic
from memlm.errors import ConfigError

# Assumptions (docs/scaling-plan.md): matmuls reach half the datasheet peak,
# collectives 80% of the link bandwidth, bandwidth-bound kernels 80% of HBM
# bandwidth; 10% of HBM is kept free (CUDA context, NCCL buffers, allocator
# fragmentation) when deciding whether a layout fits.
MATMUL_EFFICIENCY = 0.5
HBM_EFFICIENCY = 0.8
HBM_HEADROOM = 0.9
def gpu_spec(name: str) -> GPU:
    if name not in GPUS:
        raise ConfigError("--gpu", name, f"one of: {', '.join(GPUS)}")
    return GPUS[name]


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
    values: list[ValueTables] = field(default_factory=list)  # the groups of value tables ([]: none)
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
    if hasattr(ffn, "saved_bytes_per_token"):  # a module that counts its own (model/ultramem_ffn.py)
        ffn_part = norm + ffn.saved_bytes_per_token(a, layout.memory_parallel)
    elif memory is not None:
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
    engram = getattr(block, "engram", None)  # an Engram layer before the attention (model/engram_slot.py)
    engram_part = engram.saved_bytes_per_token(a) if engram is not None else 0
    return attention + ffn_part + engram_part, attention


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
    if layout.values:
        traffic = value_traffic(layout.values, layout.memory_parallel, layout.world, layout.tokens * layout.accum)
        out["memory_all_to_all"] = traffic["memory_all_to_all"]
        out["value_grad_reduce"] = traffic["value_grad"]
    return out


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
    read_bytes = sum(3 * tokens * v.reads * v.reads_per_token * v.v_dim * v.value_bytes for v in layout.values)
    memory = read_bytes / hbm
    sparse = any(v.sparse_updates for v in layout.values)  # memory.sparse_updates: one setting for every table
    table = 0 if sparse else layout.value_local_bytes
    optimizer = (28 + 4) * (table + layout.dense_local_bytes) / 4 / hbm
    fsdp = (comm["fsdp_all_gather"] + comm["fsdp_reduce_scatter"]) / link_bandwidth(gpu, layout.fsdp_spans_nodes)
    fsdp += comm["fsdp_replica_all_reduce"] / link_bandwidth(gpu, layout.world > layout.gpus_per_node)
    mem_comm = comm["memory_all_to_all"] / link_bandwidth(gpu, layout.memory_spans_nodes)
    value_reduce = comm["value_grad_reduce"] / link_bandwidth(gpu, layout.replicas_span_nodes)
    total = max(compute, fsdp) + memory + optimizer + mem_comm + value_reduce
    return {"compute_s": compute, "fsdp_comm_s": fsdp, "memory_read_s": memory, "optimizer_s": optimizer,
            "memory_comm_s": mem_comm, "value_reduce_s": value_reduce, "step_s": total,
            "tokens_per_s": tokens / total, "mfu": model_flops / (total * gpu.peak_bf16_flops)}
