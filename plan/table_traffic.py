"""The value table's traffic in one training step: counted on a real step, and planned.

    with TablePasses((n_slots, v_dim)) as passes:     # any step, on CPU: a dispatch-mode count
        trainer.train_step()
    passes.total, passes.by_op                        # table-sized tensors the step's ops took or returned

    step_table_bytes(n_slots=2**20, v_dim=1024, table_bytes=4, layers=3)   # the planner's bytes per step
    expected_rows(reads=16384 * 128, n_slots=2**20)  # distinct rows a layer's reads touch, reads spread evenly
    host_table_bytes(tokens=8192, heads=16, head_rows=[160_001] * 16, head_dim=64, layers=2)  # host <-> device

A pass is one table-sized tensor (the table, its gradient buffer, an AdamW
moment) that an op takes or returns: an upper bound on what the op moves
(a read touches only the rows it reads). Counted at the op boundary, so a
custom op (memlm::table_adamw_) is one op whatever its CPU reference does
inside; on CUDA each such op is one kernel.

The floor of a step with L layers reading one shared pool, one micro-batch:

    forward     L      each read takes the table
    backward    2 L    each read's backward takes the table (weights' gradient) and the buffer it adds into
    clip norm   1      the buffer's norm (the clip itself is applied inside the optimizer's step)
    AdamW       4      p, g, m, v in one op, which also leaves g zero for the next step

3 L + 5 in all (14 for Memory+'s 3 layers), with no autograd sum of per-layer
gradients and no separate clip multiply.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def floor_passes(layers: int, micro_batches: int = 1) -> int:
    """The stated floor: 3 passes per read and micro-batch, the norm, one AdamW op."""
    return 3 * layers * micro_batches + 5


class TablePasses(TorchDispatchMode):
    """Counts, per op, the tensors of `shape` it takes or returns (the
    table, its gradient, its moments), over everything run inside."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape = torch.Size(shape)
        self.by_op: Counter[str] = Counter()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten((args, kwargs or {}))
        n = sum(1 for t in flat if isinstance(t, torch.Tensor) and t.shape == self.shape)
        n += sum(1 for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.shape == self.shape
                 and not any(t is a for a in flat))  # an in-place op returns its input: counted once
        if n:
            name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
            namespace = getattr(func, "namespace", "")
            key = f"{namespace}::{name}" if namespace else name
            self.by_op[key] += n
            self.calls.append((key, n))
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def step_table_bytes(n_slots: int, v_dim: int, table_bytes: int, layers: int,
                     rows_read_per_layer: int | None = None) -> dict[str, int]:
    """Bytes one optimizer step moves over the value table and its state, by
    part (one micro-batch). `table_bytes`: 4 (fp32) or 2 (bf16) per element;
    the moments are fp32 either way and the gradient buffer has the table's
    dtype. `rows_read_per_layer`: distinct rows a layer's reads touch (None:
    every row, the upper bound)."""
    elems = n_slots * v_dim
    rows = n_slots if rows_read_per_layer is None else min(n_slots, rows_read_per_layer)
    table, moment = elems * table_bytes, elems * 4
    read_rows = rows * v_dim * table_bytes
    return {
        # Inside the read kernels: each layer's backward reads and writes the buffer's read rows.
        "backward_accumulate": layers * 2 * read_rows,
        # Outside them: the clip's norm reads the buffer once ...
        "clip_norm": table,
        # ... and the AdamW op reads p, g, m, v and writes p, m, v and g (zeroed).
        "optimizer": 4 * table + 4 * moment,
    }


def expected_rows(reads: int, n_slots: int) -> int:
    """Distinct rows `reads` uniform reads of `n_slots` touch, on average: N (1 - (1 - 1/N)^reads)."""
    if n_slots <= 0:
        return 0
    return round(n_slots * -math.expm1(reads * math.log1p(-1.0 / n_slots))) if n_slots > 1 else min(1, reads)


def host_table_bytes(tokens: int, head_rows: list[int], head_dim: int, layers: int, micro_batches: int = 1,
                     value_bytes: int = 4) -> dict[str, int]:
    """Bytes one optimizer step moves between host and device for Engram tables kept in host memory
    (memory.engram.tables_in=host, memlm.memory.host_tables), by direction. Each layer and micro-batch
    reads one row per token from each head's table (`head_rows`: its rows); the distinct rows are
    expected for reads spread evenly, an upper estimate for text, whose n-grams repeat. The rows are
    staged from the host (HostRowsReader.stage): each distinct row's values go to the device with each
    read's position in them (8 bytes per token and head); each distinct row's gradient comes back with
    its id (8 bytes)."""
    distinct = sum(expected_rows(tokens, rows) for rows in head_rows)
    reads = layers * micro_batches
    return {
        "to_device": reads * (distinct * head_dim * value_bytes + tokens * len(head_rows) * 8),
        "to_host": reads * distinct * (8 + head_dim * value_bytes),
        "rows": reads * distinct,
    }
