"""Rank function of tests/integration/test_hf_import.py's distributed test (spawned by run_ranks)."""

from __future__ import annotations

import torch
from train_workers import full_state

from memlm.config.run import compose
from memlm.train.trainer import Trainer


def import_and_step(rank: int, overrides: list[str], batches_path: str, out_path: str) -> None:
    """Start from the Hugging Face checkpoint, keep the full state, train one step
    on this rank's rows of the global batch; rank 0 saves both."""
    batches = torch.load(batches_path, weights_only=True)
    cfg = compose(overrides)
    b = cfg.data.micro_batch
    trainer = Trainer(cfg, train_loader=iter([(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
                                              for x, y in batches]))
    state = full_state(trainer.model)  # collective: every rank calls it
    loss = trainer.train_step()["loss"]
    trainer.close()
    if rank == 0:
        torch.save({"state": state, "loss": loss}, out_path)
