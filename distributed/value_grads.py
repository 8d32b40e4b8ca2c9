"""Summing the value tables' gradients over memory-parallel replicas.

A column-sharded value table (memlm.distributed.memory_parallel) has one copy per
replica group ("mem_replica"); each copy's gradient sums over its own group's
tokens, so the global gradient is the sum over replicas, divided by the
world size (every rank's loss is a mean over its own tokens).

    reduction = ValueGradReduction(pools, meshes.memory, world_size, accum, "fp32")
    for micro in range(accum): loss.backward()   # the last backward starts the reduction
    reduction.finish()                            # before clipping: wait, scale

Dense gradients: a post-accumulate-grad hook on each table starts an async
all-reduce as soon as autograd has written the table's gradient of the last
micro-batch, so it runs while the backward of the blocks below the first
memory layer still computes. A table whose reads add into its gradient
buffer (memlm.memory.table_grads: memlm's optimizers keep one) never goes
through autograd's accumulation, so no hook fires and `finish()` starts the
all-reduce after the backward: no overlap, one collective as before. `reduce_dtype="bf16"` sends a bf16 copy (half
the bytes; the sum is rounded to bf16, about 3 significant digits) and
writes the result back in the table's dtype.

Sparse gradients (memory.sparse_updates): each replica read different rows,
so the replicas all-gather their (rows, row gradients) and each coalesces
the union in rank order: every replica applies the same update, equal to one
process's sparse gradient. The row counts differ per replica, so this
exchanges counts first (one small collective and a host read, like the
coalescing itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from memlm.memory.sparse_adamw import set_local_sparse_grad, sparse_rows, table_grad

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ValueGradReduction:
    def __init__(self, pools: list[nn.Module], mesh: DeviceMesh, world_size: int, accum: int,
                 reduce_dtype: str = "fp32"):
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {sorted(REDUCE_DTYPES)}, got {reduce_dtype!r}")
        self.pools = pools
        self.group = mesh.get_group("mem_replica")
        self.replicas = dist.get_world_size(self.group)
        self.world_size = world_size
        self.accum = accum
        self.dtype = REDUCE_DTYPES[reduce_dtype]
        self._backwards: dict[int, int] = {}  # per table: backwards since the last finish()
        self._pending: dict[int, tuple[dist.Work, torch.Tensor, torch.Tensor]] = {}
        if self.replicas > 1:
            for pool in pools:
                pool.weight.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Autograd wrote `param.grad` of one micro-batch; after the last one, send it."""
        if param.grad is None:
            return
        if id(param) in self._pending:
            raise RuntimeError(
                f"a backward after the last of {self.accum} micro-batch(es) wrote the value table's "
                "gradient while its reduction was in flight; call finish() once per optimizer step"
            )
        calls = self._backwards[id(param)] = self._backwards.get(id(param), 0) + 1
        if calls == self.accum:
            self._pending[id(param)] = self._start(_local(param.grad))

    def _start(self, grad: torch.Tensor) -> tuple[dist.Work, torch.Tensor, torch.Tensor]:
        buf = grad if grad.dtype == self.dtype else grad.to(self.dtype)
        return dist.all_reduce(buf, group=self.group, async_op=True), buf, grad

    def finish(self) -> None:
        """Wait for (or run) every table's reduction and scale it by 1 / world size."""
        for pool in self.pools:
            param = pool.weight
            if param.grad is None:
                if table_grad(param) is not None:
                    self._finish_sparse(param)
                continue
            pending = self._pending.pop(id(param), None)
            if pending is None and self.replicas > 1:
                # The hook did not see the last backward (gradients produced
                # outside this run's micro-batch count): reduce now.
                pending = self._start(_local(param.grad))
            if pending is not None:
                work, buf, grad = pending
                work.wait()
                if buf is not grad:
                    grad.copy_(buf)
            _local(param.grad).div_(self.world_size)
        self._pending.clear()
        self._backwards.clear()

    def _finish_sparse(self, param: torch.Tensor) -> None:
        # Every rank's own rows first (several layers and micro-batches
        # accumulated into one uncoalesced tensor), then the replicas' union.
        grad = table_grad(param)
        rows, values = sparse_rows(grad)
        if self.replicas > 1:
            rows, values = _all_gather_rows(rows, values.to(self.dtype), self.group)
            values = values.to(grad.dtype)
        summed = torch.sparse_coo_tensor(rows.unsqueeze(0), values, grad.shape).coalesce()
        set_local_sparse_grad(param, summed / self.world_size)


def _all_gather_rows(rows: torch.Tensor, values: torch.Tensor,
                     group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (rows (U_r,), values (U_r, c)), concatenated in rank order."""
    n = dist.get_world_size(group)
    count = torch.tensor([rows.numel()], device=rows.device)
    counts = [torch.empty_like(count) for _ in range(n)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in torch.cat(counts).tolist()]
    most = max(sizes)
    pad = most - rows.numel()
    rows_p = torch.cat([rows, rows.new_zeros(pad)])
    values_p = torch.cat([values, values.new_zeros(pad, *values.shape[1:])])
    all_rows = [torch.empty_like(rows_p) for _ in range(n)]
    all_values = [torch.empty_like(values_p) for _ in range(n)]
    dist.all_gather(all_rows, rows_p, group=group)
    dist.all_gather(all_values, values_p, group=group)
    return (torch.cat([r[:k] for r, k in zip(all_rows, sizes)]),
            torch.cat([v[:k] for v, k in zip(all_values, sizes)]))
