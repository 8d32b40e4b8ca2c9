"""Rank functions of tests/integration/test_precision.py (spawned by distributed_workers.run_ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def column_parallel_bf16_read(rank: int, n_slots: int, v_dim: int, bags: int, k: int, out_path: str) -> None:
    """One column-parallel read and backward of a bf16 table on the ranks of
    the group, with float32 weights, through each kernel (Triton by its
    interpreter): what crosses the wire, and the numbers against plain
    float32 over the bf16 table's values. Rank 0 saves every rank's results."""
    # Before memlm.memory.fast.triton_bag is imported (by the first Triton read):
    # Triton decides to interpret when a kernel is defined. This process only.
    os.environ["TRITON_INTERPRET"] = "1"
    from torch.distributed.device_mesh import init_device_mesh

    import memlm.distributed.memory_parallel as parallel
    from memlm.memory.values import ValuePool

    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(n_slots, v_dim, generator=gen).bfloat16()
    idx = torch.randint(0, n_slots, (world, bags, k), generator=gen)
    w = torch.rand(world, bags, k, generator=gen).softmax(-1)  # float32, like the lookup's
    grad_out = torch.randn(world, bags, v_dim, generator=gen).bfloat16()  # the read is in the table's dtype
    # Reference, plain float32 over every rank's tokens: y = sum_k w * V[idx], dy/dw = V[idx] . grad_y.
    rows = table.float()[idx]  # (world, bags, k, v_dim)
    y_ref = (w.unsqueeze(-1) * rows).sum(2)
    w_grad_ref = (rows * grad_out.float().unsqueeze(2)).sum(-1)

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("mem_replica", "mem_parallel"))
    pool = ValuePool(n_slots, v_dim, dtype=torch.bfloat16)
    with torch.no_grad():
        pool.weight.copy_(table)
    parallel.shard_value_pools(pool, mesh)
    wire: list[tuple[str, str, tuple[int, ...]]] = []
    gather, all_to_all = parallel._all_gather_rows, parallel._all_to_all_rows

    def recording(name, fn):
        def run(x, group):
            wire.append((name, str(x.dtype), tuple(x.shape)))
            return fn(x, group)
        return run

    parallel._all_gather_rows = recording("all_gather", gather)
    parallel._all_to_all_rows = recording("all_to_all", all_to_all)
    result = {}
    try:
        for kernel in ("torch", "triton"):
            wire.clear()
            mine = w[rank].clone().requires_grad_()
            out = pool.read(idx[rank], mine, kernel=kernel)
            out.backward(grad_out[rank])
            scale = w_grad_ref[rank].abs().max().item()
            result[kernel] = {
                "wire": list(wire), "out_dtype": str(out.dtype), "w_grad_dtype": str(mine.grad.dtype),
                "out_rel": ((out.float() - y_ref[rank]).abs().max() / y_ref[rank].abs().max()).item(),
                "w_grad_rel": ((mine.grad - w_grad_ref[rank]).abs().max() / scale).item(),
            }
            pool.weight.grad = None
    finally:
        parallel._all_gather_rows, parallel._all_to_all_rows = gather, all_to_all
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out_path)
