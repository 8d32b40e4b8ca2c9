"""Memory parallelism: the value table sharded by columns over a group of ranks.

docs/training.md, "Value tables on several ranks". Rank r of a memory-parallel group of P ranks
holds `V[:, r*v/P:(r+1)*v/P]` for every slot. One read:

forward   all-gather every rank's (indices, weights)        (P*B, K) each
          local bag over my columns for all group tokens    (P*B, v/P)
          all-to-all: tokens go home, columns are joined     (B, v)
backward  all-to-all the output gradient back by columns    (P*B, v/P)
          local bag backward: my columns' table gradient from all group
          tokens, and partial weight gradients (my columns only)
          all-to-all the partial weight gradients home and sum them (B, K)

The weights and their partial gradients stay in the weights' dtype (float32,
from the lookup's softmax) whatever the table's: a bf16 table must not round
them (the Triton kernels read float32 weights and accumulate in float32).

The table parameter is a DTensor on the memory mesh ("mem_replica",
"mem_parallel") with placements (Replicate, Shard(1)), so checkpoints store
it once and reshard freely. Gradients on a replica are partial sums over the
group's tokens; the trainer sums them over replicas (memlm.distributed.value_grads).
`init_value_tables` draws each shard from the seed alone, so replicas agree.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from memlm.memory.fast import ops
from memlm.memory.fast.launches import NO_LAUNCHES, ReadLaunches
from memlm.memory.sparse_adamw import add_local_sparse_grad
from memlm.memory.tables import value_pools
from memlm.memory.values import seeded_normal_, tile_seed


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _all_to_all_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send row block j of x to rank j; return the blocks received, stacked in rank order."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _ColumnParallelBag(torch.autograd.Function):
    """The forward keeps the autograd graph of its local bag (which saves only
    references: table, indices, weights), so the backward differentiates it
    directly: the table is read once per forward + backward, not re-read.

    Dense: `local_values` is the shard's differentiable view (to_local) and
    gets its gradient through autograd. Sparse (`sink` set): a DTensor cannot
    hold a sparse gradient, so `table` (the parameter) only makes autograd
    run this backward, `local_values` is the detached shard, and the shard's
    row gradient (sparse COO, (N, v/P)) goes to `sink(grad)`."""

    @staticmethod
    def forward(ctx, table, local_values, indices, weights, group, kernel, sink, grad_into=None,
                launches=NO_LAUNCHES):
        # local_values: (N, v/P); indices, weights: (B, K) for this rank's tokens.
        p = dist.get_world_size(group)
        all_idx = _all_gather_rows(indices, group)  # (P*B, K)
        # The weights travel in their own dtype (float32 from the lookup's
        # softmax), not the table's: a bf16 table must not round every read
        # weight by up to 2**-9, nor their partial gradients (backward). The
        # Triton kernels read them as they are and accumulate in float32; the
        # torch (CPU) kernel reads in the table's dtype, as one process does. (P*B, K)
        all_w = _all_gather_rows(weights, group)
        needs_values = ctx.needs_input_grad[1] or (sink is not None and ctx.needs_input_grad[0])
        with torch.enable_grad():
            values = local_values.detach().requires_grad_(needs_values)
            w = all_w.detach().requires_grad_(ctx.needs_input_grad[3])
            # grad_into: the shard of the table's gradient buffer (memlm.memory.table_grads): the
            # backward adds my columns' gradient there instead of returning it.
            part = ops.embedding_bag(values, all_idx, w, sparse=sink is not None, kernel=kernel,
                                     grad_into=grad_into, launches=launches)  # (P*B, v/P)
        ctx.graph = (part, values, w) if part.requires_grad else None
        # Row block j of `part` holds rank j's tokens: send it there. What comes
        # back is, per source rank i, my tokens' column slice i.
        recv = _all_to_all_rows(part.detach(), group)  # (P*B, v/P), blocks ordered by source rank
        if ctx.graph is not None:
            # The backward needs part's graph, not its numbers (the bag's backward
            # reads table, indices and weights): free them, as the old
            # recomputing backward did.
            part.untyped_storage().resize_(0)
        b = indices.shape[0]
        out = torch.cat([recv[i * b:(i + 1) * b] for i in range(p)], dim=1)  # (B, v)
        ctx.group, ctx.p, ctx.b, ctx.sink = group, p, b, sink
        return out

    @staticmethod
    def backward(ctx, grad_out):
        part, values, w = ctx.graph
        ctx.graph = None  # the local graph is used once; free its references now
        p, b = ctx.p, ctx.b
        # Column slice i of my tokens' gradient goes to rank i (mirror of forward).
        send = torch.cat(grad_out.contiguous().chunk(p, dim=1), dim=0)  # (P*B, v/P)
        grad_part = _all_to_all_rows(send, ctx.group)  # my columns, every group token
        wanted = [t for t in (values, w) if t.requires_grad]
        # allow_unused: a read into a gradient buffer gives the shard no gradient.
        grads = torch.autograd.grad(part, wanted, grad_part, allow_unused=True)
        grad_values = grads[0] if values.requires_grad else None
        grad_w = None
        if w.requires_grad:
            partial_w = grads[-1]  # (P*B, K) in the weights' dtype: my columns' share for every group token
            recv = _all_to_all_rows(partial_w, ctx.group)  # every rank's share of my tokens
            grad_w = recv.view(p, b, -1).sum(0)  # summed in the weights' dtype (float32), not the table's
        if ctx.sink is not None:
            if grad_values is not None:
                ctx.sink(grad_values)
            grad_values = None
        return None, grad_values, None, grad_w, None, None, None, None, None


class ColumnParallelReader:
    """Installed as `pool.reader` on a column-sharded `ValuePool`. With
    `sparse`, the shard's row gradients accumulate on the parameter (see
    `memlm.memory.sparse_adamw.add_local_sparse_grad`), summed over replicas
    by the trainer."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, pool: nn.Module, indices: torch.Tensor, weights: torch.Tensor,
                 sparse: bool, kernel: str, launches: ReadLaunches = NO_LAUNCHES) -> torch.Tensor:
        table = pool.weight
        if sparse:
            local = table.detach().to_local() if isinstance(table, DTensor) else table.detach()
            sink = functools.partial(add_local_sparse_grad, table)
            return _ColumnParallelBag.apply(table, local, indices, weights, self.group, kernel, sink, None, launches)
        local = table.to_local() if isinstance(table, DTensor) else table
        buffer = pool.gradient_buffer()  # the table's gradient buffer, or None
        into = buffer.to_local() if isinstance(buffer, DTensor) else buffer  # my columns of it
        if dist.get_world_size(self.group) == 1:
            return ops.embedding_bag(local, indices, weights, kernel=kernel, grad_into=into, launches=launches)
        if not torch.is_grad_enabled():
            return _inference_read(local, indices, weights, self.group, kernel, launches)
        return _ColumnParallelBag.apply(None, local, indices, weights, self.group, kernel, None, into, launches)


def _inference_read(local: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                    group: dist.ProcessGroup, kernel: str, launches: ReadLaunches = NO_LAUNCHES) -> torch.Tensor:
    """A read outside training, where the group's ranks may hold different
    token counts (evaluation: each rank its own examples, memlm.evals.lockstep).
    The column exchange needs equal blocks, so every rank pads its (B, K) rows
    to the group's largest B with weight-0 reads of slot 0 and drops them from
    the result. Training batches are equal by construction and skip this
    exchange of counts (a collective and a host read)."""
    count = torch.tensor([indices.shape[0]], device=indices.device)
    most = int(_all_gather_rows(count, group).max())
    pad = most - indices.shape[0]
    if pad:
        indices = torch.cat([indices, indices.new_zeros(pad, indices.shape[1])])
        weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
    out = _ColumnParallelBag.apply(None, local, indices, weights, group, kernel, None, None, launches)  # (most, v)
    return out[:out.shape[0] - pad]


def shard_value_pools(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Turn every value pool's table into a (Replicate, Shard(1)) DTensor on
    `mesh` ("mem_replica", "mem_parallel") and install the column-parallel
    reader. Works on materialized tables (each rank keeps its columns) and on
    meta tables (initialized later in place)."""
    pools = value_pools(model)
    group = mesh.get_group("mem_parallel")
    p = mesh.size(1)
    for pool in pools:
        if pool.weight.shape[1] % p:
            raise ValueError(f"value table width {pool.weight.shape[1]} is not divisible by memory_parallel={p}")
        placements = [Replicate(), Shard(1)]
        weight = pool.weight.detach()
        if weight.is_meta:
            local = torch.empty(weight.shape[0], weight.shape[1] // p, dtype=weight.dtype, device="meta")
            dt = DTensor.from_local(local, mesh, placements, run_check=False)
        else:
            dt = distribute_tensor(weight, mesh, placements, src_data_rank=None)
        pool.weight = nn.Parameter(dt)
        pool.reader = ColumnParallelReader(group)
    return pools


@torch.no_grad()
def init_value_tables(pools: list[nn.Module], seed: int) -> None:
    """Initialize every pool's table (or this rank's column shard of it) from
    `seed` and the pool's position alone (memory.values.seeded_normal_): every
    replica of a shard gets the same numbers, and the shards of any
    memory-parallel split join into the table one process draws."""
    for i, pool in enumerate(pools):
        table = pool.weight.detach()
        col0 = 0
        if isinstance(table, DTensor):
            local = table.to_local()
            for dim, placement in enumerate(table.placements):
                if placement.is_shard():
                    col0 = table.device_mesh.get_local_rank(dim) * local.shape[1]
        else:
            local = table
        seeded_normal_(local, tile_seed(seed, i), pool.init_std, col_offset=col0, full_cols=pool.v_dim)
