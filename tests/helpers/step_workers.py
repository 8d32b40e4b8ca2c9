"""Counters for the sync-free step tests, and their rank functions (spawned by run_ranks).

`count_collectives()` wraps every torch.distributed collective (c10d and the
functional collectives DTensor uses) and records, per call, whether FSDP
issued it (its per-block parameter all-gathers and gradient reduce-scatters,
which grow with the number of blocks by design) and the trainer's step at
the time."""

from __future__ import annotations

import contextlib
import json
import sys
import threading

import torch

C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
        "all_to_all_single", "all_to_all", "broadcast", "barrier", "all_gather_object", "broadcast_object_list")
FUNCOL = ("all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
          "reduce_scatter_tensor_autograd", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
          "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")


def _issued_by_fsdp() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/distributed/fsdp/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def count_collectives(tag=lambda: None):
    """Yields a list that receives (tag(), name, issued_by_fsdp) per outermost collective call."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    calls: list[tuple] = []
    local = threading.local()
    patched = []

    def wrap(fn, name):
        def counted(*args, **kwargs):
            if getattr(local, "depth", 0) == 0:
                calls.append((tag(), name, _issued_by_fsdp()))
            local.depth = getattr(local, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth -= 1
        return counted

    for module, names, prefix in ((c10d, C10D, "c10d"), (funcol, FUNCOL, "funcol")):
        for name in names:
            fn = getattr(module, name, None)
            if fn is None:
                continue
            wrapped = wrap(fn, f"{prefix}.{name}")
            patched.append((module, name, fn))
            setattr(module, name, wrapped)
            if module is c10d and getattr(dist, name, None) is fn:
                patched.append((dist, name, fn))
                setattr(dist, name, wrapped)
    try:
        yield calls
    finally:
        for module, name, fn in reversed(patched):
            setattr(module, name, fn)


def collectives_per_step(rank: int, runs: dict[str, list[str]], out_path: str, steps: int = 4) -> None:
    """For each named config: fit() for `steps` steps with no logging step
    before the last, counting collectives; rank 0 writes, per run, the calls
    made during non-logging step 2 (the loop body after step 2 and step 3's
    train_step), split into FSDP's and the others."""
    from memlm.config.run import compose
    from memlm.train.trainer import Trainer

    out = {}
    for name, overrides in runs.items():
        trainer = Trainer(compose([*overrides, f"steps={steps}", "logging.every=1000"]))
        with count_collectives(lambda t=trainer: t.step) as calls:
            trainer.fit()
        middle = [(n, fsdp) for step, n, fsdp in calls if step == 2]
        out[name] = {"other": sorted(n for n, fsdp in middle if not fsdp),
                     "fsdp": sum(1 for _, fsdp in middle if fsdp)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def nan_grad_step_on_ranks(rank: int, overrides: list[str], nan_param: str, out_path: str) -> None:
    """Two ranks (FSDP2 DTensors, fused AdamW with found_inf): step 2's gradient
    of `nan_param` is NaN. Rank 0 saves the full weights and optimizer state
    after step 1 and after step 2, and what a save of a poisoned model raised."""
    from fault_injection import nan_grad_at
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from train_workers import full_optim_state

    from memlm.checkpoint.checkpointer import CheckpointError
    from memlm.config.run import compose
    from memlm.train.trainer import Trainer

    trainer = Trainer(compose(overrides))
    nan_grad_at(trainer, {2: nan_param})
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    trainer.train_step()
    after_1 = (get_model_state_dict(trainer.model, options=opts), full_optim_state(trainer))
    metrics = trainer.train_step()
    after_2 = (get_model_state_dict(trainer.model, options=opts), full_optim_state(trainer))
    # Poison one shard on rank 1 only: every rank must refuse the save.
    if rank == 1:
        with torch.no_grad():
            next(trainer.model.parameters()).to_local().view(-1)[0] = float("inf")
    try:
        trainer.save_checkpoint()
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    refused_all = [None] * 2
    torch.distributed.all_gather_object(refused_all, refused)
    if rank == 0:
        torch.save({"after_1": after_1, "after_2": after_2, "metrics": metrics, "refused": refused_all,
                    "nonfinite_total": trainer.nonfinite_total}, out_path)


def clip_on_two_meshes(rank: int, out_path: str) -> None:
    """clip_group_ over DTensor gradients on two meshes (FSDP-like Shard(0) on
    a 1-D mesh, value-table-like (Replicate, Shard(1)) on a 2-D one) and a
    plain tensor; rank 0 saves the norm, the reference norm of the full
    gradients, and the clipped full gradients."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from memlm.distributed.clip import clip_group_

    flat = init_device_mesh("cpu", (2,))
    grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("mem_replica", "mem_parallel"))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(8, 4, generator=gen) for _ in range(3)] + [torch.randn(6, 8, generator=gen)]
    params = []
    for i, g in enumerate(full):
        if i < 2:
            p = nn.Parameter(distribute_tensor(torch.zeros_like(g), flat, [Shard(0)]))
            p.grad = distribute_tensor(g.clone(), flat, [Shard(0)])
        elif i == 2:
            p = nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
        else:
            p = nn.Parameter(distribute_tensor(torch.zeros_like(g), grid, [Replicate(), Shard(1)]))
            p.grad = distribute_tensor(g.clone(), grid, [Replicate(), Shard(1)])
        params.append(p)
    norm = clip_group_(params, max_norm=1.0)
    clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    if rank == 0:
        torch.save({"norm": norm, "full": full, "clipped": clipped}, out_path)
