"""Memory parallelism: the value table sharded by columns over a group of ranks.

MEMORY_LAYERS.md section 6. Rank r of a memory-parallel group of P ranks
holds `V[:, r*v/P:(r+1)*v/P]` for every slot. One read:

forward   all-gather every rank's (indices, weights)        (P*B, K) each
          local bag over my columns for all group tokens    (P*B, v/P)
          all-to-all: tokens go home, columns are joined     (B, v)
backward  all-to-all the output gradient back by columns    (P*B, v/P)
          local bag backward: my columns' table gradient from all group
          tokens, and partial weight gradients (my columns only)
          all-to-all the partial weight gradients home and sum them (B, K)

The table parameter is a DTensor on the memory mesh ("mem_replica",
"mem_parallel") with placements (Replicate, Shard(1)), so checkpoints store
it once and reshard freely. Gradients on a replica are partial sums over the
group's tokens; `reduce_value_grads` sums them over replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from memlm.memory import ops


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
    @staticmethod
    def forward(ctx, local_values, indices, weights, group, kernel):
        # local_values: (N, v/P); indices, weights: (B, K) for this rank's tokens.
        p = dist.get_world_size(group)
        all_idx = _all_gather_rows(indices, group)  # (P*B, K)
        all_w = _all_gather_rows(weights.to(local_values.dtype), group)
        part = ops.embedding_bag(local_values.detach(), all_idx, all_w.detach(), kernel=kernel)  # (P*B, v/P)
        # Row block j of `part` holds rank j's tokens: send it there. What comes
        # back is, per source rank i, my tokens' column slice i.
        recv = _all_to_all_rows(part, group)  # (P*B, v/P), blocks ordered by source rank
        b = indices.shape[0]
        out = torch.cat([recv[i * b:(i + 1) * b] for i in range(p)], dim=1)  # (B, v)
        ctx.save_for_backward(local_values, all_idx, all_w)
        ctx.group, ctx.kernel, ctx.p, ctx.b = group, kernel, p, b
        ctx.weights_dtype = weights.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        local_values, all_idx, all_w = ctx.saved_tensors
        p, b = ctx.p, ctx.b
        # Column slice i of my tokens' gradient goes to rank i (mirror of forward).
        send = torch.cat(grad_out.contiguous().chunk(p, dim=1), dim=0)  # (P*B, v/P)
        grad_part = _all_to_all_rows(send, ctx.group)  # my columns, every group token
        with torch.enable_grad():
            values = local_values.detach().requires_grad_(ctx.needs_input_grad[0])
            w = all_w.detach().requires_grad_()
            part = ops.embedding_bag(values, all_idx, w, kernel=ctx.kernel)
            wanted = [t for t in (values, w) if t.requires_grad]
            grads = torch.autograd.grad(part, wanted, grad_part)
        grad_values = grads[0] if ctx.needs_input_grad[0] else None
        partial_w = grads[-1]  # (P*B, K): my columns' share for every group token
        recv = _all_to_all_rows(partial_w, ctx.group)  # every rank's share of my tokens
        grad_w = recv.view(p, b, -1).sum(0).to(ctx.weights_dtype)
        return grad_values, None, grad_w, None, None


class ColumnParallelReader:
    """Installed as `pool.reader` on a column-sharded `ValuePool`."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, pool: nn.Module, indices: torch.Tensor, weights: torch.Tensor,
                 sparse: bool, kernel: str) -> torch.Tensor:
        if sparse:
            raise NotImplementedError("sparse value updates are not supported with a sharded value table yet")
        local = pool.weight.to_local() if isinstance(pool.weight, DTensor) else pool.weight
        if dist.get_world_size(self.group) == 1:
            return ops.embedding_bag(local, indices, weights, kernel=kernel)
        return _ColumnParallelBag.apply(local, indices, weights, self.group, kernel)


def value_pools(model: nn.Module) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for module in model.modules():
        if getattr(module, "param_category", None) == "memory" and hasattr(module, "reader"):
            seen[id(module)] = module
    return list(seen.values())


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


def reduce_value_grads(pools: list[nn.Module], mesh: DeviceMesh, world_size: int) -> None:
    """Sum each table's gradient over the replica groups and divide by the
    world size: every rank's loss is a mean over its own tokens, so the
    global-batch gradient is the average over all ranks."""
    group = mesh.get_group("mem_replica")
    for pool in pools:
        grad = pool.weight.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if dist.get_world_size(group) > 1:
            dist.all_reduce(local, group=group)
        local.div_(world_size)
