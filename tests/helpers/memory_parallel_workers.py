"""Rank functions of tests/integration/test_memory_parallel_scale.py (spawned by run_ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from train_workers import full_state

from memlm.config.run import compose
from memlm.distributed.memory_parallel import shard_value_pools
from memlm.memory.fast import ops
from memlm.memory.sparse_adamw import table_grad
from memlm.memory.values import ValuePool
from memlm.train.trainer import Trainer

TABLE = "shared.memory_values.weight"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sharded_init(rank: int, overrides: list[str], out_path: str) -> None:
    """Build init=sharded and init=full; rank 0 saves every rank's value shard
    of the sharded build and both full tables."""
    sharded = Trainer(compose([*overrides, "parallel.init=sharded"]), train_loader=iter([]))
    shard = _local(sharded.model.shared.memory_values.weight).detach()
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, shard.contiguous())
    table_sharded = full_state(sharded.model).get(TABLE)  # rank 0 only (cpu_offload)
    sharded.close()  # its run lock: the next Trainer uses the same dump_dir
    full = Trainer(compose([*overrides, "parallel.init=full"]), train_loader=iter([]))
    table_full = full_state(full.model).get(TABLE)
    if rank == 0:
        torch.save({"shards": shards, "sharded": table_sharded, "full": table_full}, out_path)


def _micro_batches(vocab: int, n: int, batch: int, seq: int, rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, vocab, (n, batch, seq + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _value_grad_after(trainer: Trainer, batches, finish: bool = True) -> torch.Tensor:
    trainer.optimizer.zero_grad(set_to_none=True)
    for inputs, targets in batches:
        (trainer._forward_loss(inputs, targets) / len(batches)).backward()
    if finish:
        trainer.value_grads.finish()
    return _local(trainer.model.shared.memory_values.weight.grad).detach().clone()


def reduction_paths(rank: int, overrides: list[str], out_path: str) -> None:
    """Two micro-batches per step: the hook path (fp32, bf16) against the old
    blocking reduction after the backward (raw gradients, all_reduce, divide)."""
    trainer = Trainer(compose(overrides), train_loader=iter([]))
    reduction = trainer.value_grads
    assert trainer.accum == 2, trainer.accum
    batches = _micro_batches(trainer.cfg.model.vocab_size, 2, trainer.cfg.data.micro_batch,
                             trainer.cfg.data.seq_len, rank)
    # The hook starts the reduction during the second backward, not the first.
    trainer.optimizer.zero_grad(set_to_none=True)
    (trainer._forward_loss(*batches[0]) / 2).backward()
    started_after_first = len(reduction._pending)  # reductions the hook launched
    (trainer._forward_loss(*batches[1]) / 2).backward()
    started_after_second = len(reduction._pending)
    reduction.finish()
    hooked = _local(trainer.model.shared.memory_values.weight.grad).detach().clone()
    reduction.dtype = torch.bfloat16
    hooked_bf16 = _value_grad_after(trainer, batches)
    reduction.accum = 10**9  # the hook never fires: raw gradients, reduced the old way below
    old = _value_grad_after(trainer, batches, finish=False)
    dist.all_reduce(old, group=trainer.meshes.memory.get_group("mem_replica"))
    old /= dist.get_world_size()
    if rank == 0:
        torch.save({"started": [started_after_first, started_after_second], "hooked": hooked,
                    "hooked_bf16": hooked_bf16, "old": old}, out_path)


def column_parallel_read(rank: int, n_slots: int, v_dim: int, bags: int, k: int, sparse: bool,
                         out_path: str) -> None:
    """One column-parallel read and backward on 2 ranks against the plain bag
    over the full table and every rank's tokens; counts the bag calls."""
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(n_slots, v_dim, generator=gen)
    idx = torch.randint(0, n_slots, (world, bags, k), generator=gen)
    w = torch.rand(world, bags, k, generator=gen)
    grad_out = torch.randn(world, bags, v_dim, generator=gen)
    # Reference: one process, every rank's tokens.
    ref_table = table.clone().requires_grad_()
    ref_w = w.clone().requires_grad_()
    y = F.embedding_bag(idx.flatten(0, 1), ref_table, per_sample_weights=ref_w.flatten(0, 1), mode="sum")
    y.backward(grad_out.flatten(0, 1))

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("mem_replica", "mem_parallel"))
    pool = ValuePool(n_slots, v_dim)
    with torch.no_grad():
        pool.weight.copy_(table)
    shard_value_pools(pool, mesh)
    calls = []
    real = ops.embedding_bag

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    ops.embedding_bag = counting
    try:
        mine_w = w[rank].clone().requires_grad_()
        out = pool.read(idx[rank], mine_w, sparse=sparse, kernel="torch")
        out.backward(grad_out[rank])
    finally:
        ops.embedding_bag = real
    grad = table_grad(pool.weight)
    grad = grad.to_dense() if grad.is_sparse else _local(grad)
    cols = slice(rank * v_dim // world, (rank + 1) * v_dim // world)
    result = {
        "calls": len(calls),
        "out_diff": (out - y.detach()[rank * bags:(rank + 1) * bags]).abs().max().item(),
        "table_grad_diff": (grad - ref_table.grad[:, cols]).abs().max().item(),
        "weights_grad_diff": (mine_w.grad - ref_w.grad[rank]).abs().max().item(),
        "sparse_grad": table_grad(pool.weight).is_sparse,
    }
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out_path)
