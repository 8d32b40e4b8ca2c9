"""Ranks of tests/test_async_backend.py: an async checkpoint save on a process
group with and without a CPU backend (spawned by distributed_workers.run_ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def async_save_on(rank: int, backend: str, dump_dir: str, out_path: str) -> None:
    """Init the default group with `backend`, save a tiny model with
    checkpoint.async_save=true, and record what happened."""
    from memlm.train.checkpoint import Checkpointer, CheckpointError
    from memlm.train.config import CheckpointConfig

    dist.init_process_group(backend)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    checkpointer = Checkpointer(Path(dump_dir), CheckpointConfig(async_save=True))
    try:
        checkpointer.save(1, model, optimizer, scheduler, None, {"tokens": 0}, "")
        checkpointer.finalize()
        outcome = {"ok": True}
    except CheckpointError as err:
        outcome = {"ok": False, "error": str(err)}
    if rank == 0:
        Path(out_path).write_text(json.dumps(outcome))
