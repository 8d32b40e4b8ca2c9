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
    values = table[rows] -> device      # (U, v): U * v * 4 bytes host to device
    out = bag(values, local, weights)   # the ordinary read (memory/fast/ops.py)
    backward: staged's row gradient (U, v) -> host, kept beside the table
              (sparse_adamw.add_local_sparse_grad): U * v * 4 bytes device to host

The row optimizer (memlm.memory.SparseRowAdamW, memory.sparse_updates) then
updates those rows in host memory after the backward.

Rows known ahead. A training step knows its rows before the forward: they
are a function of the batch's tokens, which are on the host before they go
to the device. `stage` takes them computed there, so the read skips the
unique on the device and the device-to-host copy of ids (a host sync):

    pool.reader.stage(pool, rows_host, device)  # (B, T, H) on the host, before the forward; the next read uses them
    out = pool.read(indices, weights)   # indices: the same rows on the device (checked, without a host sync)

`StageRows` is the training loop's component that does this for every Engram
layer whose table is on the host (memlm.train.extensions' `before_forward`):

    extensions.add(StageRows(engrams))  # engrams: the Engram layers read through HostRowsReader

A staged set serves the next read only; a read with none staged (validation,
an activation-checkpointing recompute) takes the path above. `rows` are sorted,
so `local` orders the reads as the table's own slots do: the staged read's
coalesced row gradient holds the same bags in the same order as a read of
the whole table with sparse=True. On CPU both (tables_in host and device) train bit for bit
alike (tests/integration/test_engram_host.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from memlm.memory.fast import ops
from memlm.memory.fast.launches import NO_LAUNCHES, ReadLaunches
from memlm.memory.sparse_adamw import add_local_sparse_grad

STALE_STAGE = ("the rows staged for this read are not its indices: stage() the rows of the micro-batch about to be "
               "read, hashed from its own tokens")


class HostRowsReader:
    """Installed as `pool.reader` by `keep_on_host` (module docstring)."""

    def __init__(self):
        self.staged: tuple | None = None  # (rows_host (U,), rows (U,), values (U, v), local (n, 1)) for the next read

    def stage(self, pool: nn.Module, rows_host: torch.Tensor, device: torch.device | str) -> None:
        """Gather the rows of the next read from `rows_host` (any shape, on the host) and start their copy to
        `device`; the read's indices must be the same rows as (numel, 1)."""
        rows, local = torch.unique(rows_host.reshape(-1, 1), sorted=True, return_inverse=True)  # (U,), (n, 1)
        values = pool.weight.detach().index_select(0, rows)  # (U, v)
        if torch.device(device).type == "cuda":
            values, local = values.pin_memory(), local.pin_memory()
        self.staged = (rows, rows.to(device, non_blocking=True), values.to(device, non_blocking=True),
                       local.to(device, non_blocking=True))

    def __call__(self, pool: nn.Module, indices: torch.Tensor, weights: torch.Tensor, sparse: bool, kernel: str,
                 launches: ReadLaunches = NO_LAUNCHES) -> torch.Tensor:
        table = pool.weight  # (N, v) in host memory
        ahead, self.staged = self.staged, None
        if ahead is not None:
            rows_host, rows, values, local = ahead
            if local.shape != indices.shape:
                raise ValueError(f"the rows staged for this read have shape {tuple(local.shape)}, the read's indices "
                                 f"{tuple(indices.shape)}: stage() the rows of the batch about to be read")
            # Every read names the row staged for it (a stage of another micro-batch has the same shape). On the
            # device this check is asynchronous: no host sync; a mismatch fails the step's next synchronization.
            torch._assert_async((rows[local] == indices).all(), STALE_STAGE)
        else:
            rows, local = torch.unique(indices, sorted=True, return_inverse=True)  # (U,), (B, K)
            rows_host = rows.to(table.device)  # the read's one device-to-host copy: a host sync on CUDA
            values = table.detach().index_select(0, rows_host).to(indices.device, non_blocking=True)  # (U, v)
        if torch.is_grad_enabled() and table.requires_grad:
            values.requires_grad_(True)  # a leaf: its row gradient goes to the table by the hook
            values.register_hook(lambda grad: _to_table(table, rows_host, grad))
        return ops.embedding_bag(values, local, weights, sparse=True, kernel=kernel, launches=launches)


def _to_table(table: torch.Tensor, rows_host: torch.Tensor, grad: torch.Tensor) -> None:
    """Hand the staged rows' gradient (sparse (U, v), coalesced, local ids) to the host table as its rows."""
    local_ids = grad._indices()[0].to(rows_host.device)
    values = grad._values().to(table.device)
    add_local_sparse_grad(table, torch.sparse_coo_tensor(
        rows_host[local_ids].unsqueeze(0), values, table.shape, is_coalesced=True, check_invariants=False))


class StageRows:
    """A training-loop component (memlm.train.extensions): before each micro-batch's forward, every host table's
    rows for it, hashed from its tokens on the host and staged (`HostRowsReader.stage`)."""

    def __init__(self, engrams: Sequence[nn.Module]):
        self.engrams = list(engrams)  # memlm.memory.engram.Engram layers read through HostRowsReader
        self.hashers: list[nn.Module] | None = None  # each layer's hash on the host, made at the first forward

    def before_forward(self, inputs: torch.Tensor) -> None:  # inputs: (B, T) token ids
        if self.hashers is None:  # after a resume has loaded the token map into the hashes' buffers
            self.hashers = [copy.deepcopy(engram.hash).to("cpu") for engram in self.engrams]
        tokens = inputs.to("cpu")
        for engram, hasher in zip(self.engrams, self.hashers, strict=True):
            engram.tables.reader.stage(engram.tables, hasher(tokens), engram.w_k.weight.device)  # (B, T, H) rows


def keep_on_host(pool: nn.Module) -> None:
    """Move `pool`'s table to host memory (pinned when CUDA is available) and read it through `HostRowsReader`.
    The Parameter object stays the same, so an optimizer or checkpoint holding it still does."""
    if pool.reader is not None:
        raise ValueError(f"a value pool with a reader ({type(pool.reader).__name__}) cannot also be kept on the "
                         "host: memory parallelism and host tables are exclusive")
    with torch.no_grad():
        host = pool.weight.detach().to("cpu")
        if torch.cuda.is_available():
            host = host.pin_memory()
        pool.weight.data = host
    pool.reader = HostRowsReader()
