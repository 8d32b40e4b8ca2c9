"""Rank functions of tests/integration/test_plan.py and tests/integration/test_value_layout.py
(spawned by run_ranks): the bytes a real training rank holds and the
collectives it issues in one step; the value-gradient traffic of a few steps."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from train_workers import full_state

from memlm.config.run import compose
from memlm.distributed import value_grads
from memlm.distributed.memory_hooks import resolve_memory_parallel
from memlm.train.trainer import Trainer

# FSDP2 calls all_gather_single / reduce_scatter_single (torch >= 2.12) or the
# *_tensor names (older); the memory layers all_gather and all_to_all_single.
COUNTED = [name for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
                             "reduce_scatter_tensor", "all_gather", "all_to_all_single", "all_reduce")
           if hasattr(dist, name)]
KIND = {"all_gather_single": "fsdp_all_gather", "all_gather_into_tensor": "fsdp_all_gather",
        "reduce_scatter_single": "fsdp_reduce_scatter", "reduce_scatter_tensor": "fsdp_reduce_scatter",
        "all_gather": "memory_all_to_all", "all_to_all_single": "memory_all_to_all",
        "all_reduce": "all_reduce"}


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _sent(name: str, args: tuple, kwargs: dict) -> int:
    """Bytes this rank sends in a ring implementation of the collective."""
    n = dist.get_world_size(kwargs.get("group", args[2] if len(args) > 2 and name != "all_reduce" else None))
    if name == "all_reduce":  # (tensor,)
        return 2 * (n - 1) * _bytes(kwargs.get("tensor", args[0] if args else None)) // n
    output = kwargs["output"] if "output" in kwargs else args[0]
    input_ = kwargs["input"] if "input" in kwargs else args[1]
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return (n - 1) * _bytes(output)
    if name == "all_to_all_single":
        return (n - 1) * _bytes(input_) // n
    return (n - 1) * _bytes(input_)  # all-gathers: my block to every other rank


def held_bytes(rank: int, overrides: list[str], out_dir: str) -> None:
    """Train one step; record the parameter and gradient bytes just before the
    optimizer step, the optimizer-state bytes just after, and the bytes sent
    by each collective kind during the step."""
    cfg = compose(overrides)
    b, s, vocab = cfg.data.micro_batch, cfg.data.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(rank))
    trainer = Trainer(cfg, train_loader=iter([(tokens[:, :-1], tokens[:, 1:])]))
    record: dict = {"comm": {}}
    step = trainer.optimizer.step

    def measured_step(*args, **kwargs):
        record["params"] = sum(_bytes(p) for p in trainer.model.parameters())
        record["grads"] = sum(_bytes(p.grad) for p in trainer.model.parameters() if p.grad is not None)
        out = step(*args, **kwargs)
        record["optimizer"] = sum(_bytes(v) for st in trainer.optimizer.state.values() for v in st.values()
                                  if isinstance(v, torch.Tensor))
        return out

    trainer.optimizer.step = measured_step
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name):
        def call(*args, **kwargs):
            kind = KIND[name]
            if kind == "all_reduce":  # the value-table gradient, or a scalar (the loss)
                t = kwargs.get("tensor", args[0] if args else None)
                kind = "value_grad_reduce" if t.numel() > 1 else "scalar_all_reduce"
            record["comm"][kind] = record["comm"].get(kind, 0) + _sent(name, args, kwargs)
            return originals[name](*args, **kwargs)
        return call

    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        trainer.train_step()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(record, f)


def value_grad_traffic(rank: int, overrides: list[str], batches_path: str, steps: int, out_dir: str) -> None:
    """Each rank trains `steps` steps on its rows of fixed global batches, at
    the memory_parallel the trainer resolves, and records per step the bytes
    it sent for the value gradients (every collective the value-gradient
    reduction issues: distributed/value_grads.py) and in the memory all-to-alls,
    and, for touched-row exchanges, the most rows any replica sent; rank 0
    also saves the metrics and the weights."""
    batches = torch.load(batches_path, weights_only=True)
    cfg = compose(overrides)
    # What the trainer's set-up does with parallel.memory_parallel=auto.
    cfg.parallel.memory_parallel = resolve_memory_parallel(cfg, int(os.environ["WORLD_SIZE"]),
                                                           int(os.environ["LOCAL_WORLD_SIZE"]))
    b = cfg.data.micro_batch
    mine = iter([tuple(t[rank * b:(rank + 1) * b] for t in batch) for batch in batches])
    trainer = Trainer(cfg, train_loader=mine)
    resolved = trainer.meshes.memory.size(1) if trainer.meshes.memory is not None else 1
    reduction = trainer.value_grads
    inside = {"on": False, "gathers": 0}

    def flagged(fn):
        def call(*args, **kwargs):
            inside.update(on=True, gathers=0)
            try:
                return fn(*args, **kwargs)
            finally:
                inside["on"] = False
        return call

    if isinstance(reduction, value_grads.ValueGradReduction):
        reduction._start = flagged(reduction._start)  # the dense all-reduce (from the hook or finish)
        reduction._finish_sparse = flagged(reduction._finish_sparse)  # the touched-row exchange
    originals = {name: getattr(dist, name) for name in COUNTED}
    step: dict = {}

    def counting(name):
        def call(*args, **kwargs):
            kind = "value_grad" if inside["on"] else KIND[name]
            if kind != "all_reduce":  # a scalar all-reduce (the loss, the norms) is not planned
                step[kind] = step.get(kind, 0) + _sent(name, args, kwargs)
            out = originals[name](*args, **kwargs)
            if inside["on"] and name == "all_gather":
                if inside["gathers"] == 0:  # the first: the replicas' row counts (distributed/value_grads.py)
                    counts = kwargs.get("tensor_list", args[0] if args else None)
                    step["rows_touched"] = max(step.get("rows_touched", 0), max(int(c) for c in counts))
                inside["gathers"] += 1
            return out
        return call

    record: dict = {"memory_parallel": resolved, "steps": []}
    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        metrics = []
        for _ in range(steps):
            step.clear()
            metrics.append(trainer.train_step())
            record["steps"].append(dict(step))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    with open(f"{out_dir}/traffic{rank}.json", "w") as f:
        json.dump(record, f)
    state = full_state(trainer.model)
    if rank == 0:
        torch.save({"metrics": metrics, "state": state}, f"{out_dir}/dist.pt")
