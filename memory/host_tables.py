"""A value table kept in host memory while the model is on the device.

Engram's rows are a function of the tokens alone (memory/engram_hash.py), so
a step reads a small, known set of them; the table itself need not sit in
device memory. `keep_on_host` leaves a value pool's table in host memory
(pinned when the model is on CUDA) and installs `HostRowsReader` as the
pool's reader (memory/values.py):

    model.to("cuda")
    keep_on_host(pool)                  # pool.weight back on the host, the reader installed
    out = pool.read(indices, weights)   # indices, weights (B, K) on the device -> (B, v)

One read, U the distinct rows it names:

    rows, local = unique(indices)       # (U,), (B, K) on the device; rows sorted
    rows -> host                        # U * 8 bytes: the read's one device-to-host copy
    staged = table[rows] -> device      # (U, v): U * v * 4 bytes host to device
    out = bag(staged, local, weights)   # the ordinary read (memory/fast/ops.py)
    backward: staged's row gradient (U, v) -> host, kept beside the table
              (sparse_adamw.add_local_sparse_grad): U * v * 4 bytes device to host

The row optimizer (memlm.memory.SparseRowAdamW, memory.sparse_updates) then
updates those rows in host memory after the backward. `rows` are sorted,
so `local` orders the reads as the table's own slots do: the staged read's
coalesced row gradient holds the same bags in the same order as a read of
the whole table with sparse=True. On CPU the two placements train bit for bit
alike (tests/integration/test_engram_host.py).
"""

from __future__ import annotations

import torch
from torch import nn

from memlm.memory.fast import ops
from memlm.memory.fast.launches import NO_LAUNCHES, ReadLaunches
from memlm.memory.sparse_adamw import add_local_sparse_grad


class HostRowsReader:
    """Installed as `pool.reader` by `keep_on_host` (module docstring)."""

    def __call__(self, pool: nn.Module, indices: torch.Tensor, weights: torch.Tensor, sparse: bool, kernel: str,
                 launches: ReadLaunches = NO_LAUNCHES) -> torch.Tensor:
        table = pool.weight  # (N, v) in host memory
        device = indices.device
        rows, local = torch.unique(indices, sorted=True, return_inverse=True)  # (U,), (B, K)
        rows_host = rows.to(table.device)
        staged = table.detach().index_select(0, rows_host).to(device, non_blocking=True)  # (U, v)
        if torch.is_grad_enabled() and table.requires_grad:
            staged.requires_grad_(True)
            staged.register_hook(lambda grad: _to_table(table, rows_host, grad))
        return ops.embedding_bag(staged, local, weights, sparse=True, kernel=kernel, launches=launches)


def _to_table(table: torch.Tensor, rows_host: torch.Tensor, grad: torch.Tensor) -> None:
    """Hand the staged rows' gradient (sparse (U, v), coalesced, local ids) to the host table as its rows."""
    local_ids = grad._indices()[0].to(rows_host.device)
    values = grad._values().to(table.device)
    add_local_sparse_grad(table, torch.sparse_coo_tensor(
        rows_host[local_ids].unsqueeze(0), values, table.shape, is_coalesced=True, check_invariants=False))


def keep_on_host(pool: nn.Module) -> None:
    """Move `pool`'s table to host memory (pinned when CUDA is available) and read it through `HostRowsReader`.
    The Parameter object stays the same, so an optimizer or checkpoint holding it still does."""
    if pool.reader is not None:
        raise ValueError(f"a value pool with a reader ({type(pool.reader).__name__}) cannot also be kept on the "
                         "host: memory parallelism and host placement are exclusive")
    with torch.no_grad():
        host = pool.weight.detach().to("cpu")
        if torch.cuda.is_available():
            host = host.pin_memory()
        pool.weight.data = host
    pool.reader = HostRowsReader()
