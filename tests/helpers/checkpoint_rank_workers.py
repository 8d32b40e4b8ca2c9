"""Ranks of tests/integration/test_checkpoint_ranks.py (spawned by distributed_workers.run_ranks):
an async checkpoint save on a process group with and without a CPU backend,
and the bytes each rank hashes at a save and a resume."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def async_save_on(rank: int, dump_dir: str, out_path: str) -> None:
    """On the group run_ranks opened (its `backend`), save a tiny model with
    checkpoint.async_save=true, and record what happened."""
    from memlm.checkpoint.checkpointer import Checkpointer, CheckpointError, TrainingState
    from memlm.config.run import CheckpointConfig

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    checkpointer = Checkpointer(Path(dump_dir), CheckpointConfig(async_save=True))
    try:
        checkpointer.save(1, TrainingState(model, optimizer, scheduler, counters={"tokens": 0}))
        checkpointer.finalize()
        outcome = {"ok": True}
    except CheckpointError as err:
        outcome = {"ok": False, "error": str(err)}
    if rank == 0:
        Path(out_path).write_text(json.dumps(outcome))


def hashed_bytes_per_rank(rank: int, dump_dir: str, out_path: str) -> None:
    """Save and resume-verify an FSDP2-sharded model; record the bytes this rank
    ran crc32 over in each, and the checkpoint's total."""
    from torch.distributed.fsdp import fully_shard

    import memlm.checkpoint.folder as checkpoint_dir
    from memlm.checkpoint.checkpointer import Checkpointer, TrainingState
    from memlm.config.run import CheckpointConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 256)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    counted = {"save": 0, "resume": 0}
    phase = ["save"]
    real = checkpoint_dir.crc32_file

    def counting(path):
        counted[phase[0]] += path.stat().st_size
        return real(path)

    checkpoint_dir.crc32_file = counting
    checkpointer = Checkpointer(Path(dump_dir), CheckpointConfig())
    final = checkpointer.save(1, TrainingState(model, optimizer, scheduler, counters={"tokens": 0}))
    phase[0] = "resume"
    assert checkpointer.resolve("auto") == final
    total = sum(p.stat().st_size for p in final.iterdir() if p.name != "meta.json")
    Path(out_path + f".{rank}").write_text(json.dumps({**counted, "total": total}))
