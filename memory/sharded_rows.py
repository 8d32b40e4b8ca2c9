"""Global row indices of a table -> the rows this process holds, for a table sharded by rows.

    rows = local_rows(table, rows)   # (R,) int64 ascending global rows -> local ones, ascending

A plain table, or one sharded by columns (memory parallelism's value pools),
holds every row: the rows come back as they are. A DTensor sharded on dim 0
(FSDP2's default placement, UltraMemV2's pre-values P) holds the rows
[offset, offset + local rows): the rows in that range come back shifted to
start at 0, the others are dropped.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if not isinstance(table, DTensor) or not any(p.is_shard(0) for p in table.placements):
        return rows
    shape, offset = compute_local_shape_and_global_offset(table.shape, table.device_mesh, table.placements)
    first, held = offset[0], shape[0]
    kept = rows[(rows >= first) & (rows < first + held)]
    return kept - first
