"""Rank function of the world-size-change resume tests (spawned by run_ranks, so importable).

    fit_recording(rank, overrides, out_dir)   # a whole run; writes out_dir/inputs_rank{r}.pt

Each rank records the inputs of every micro-batch its trainer draws, in order,
so a test can reassemble the global batches of a run on any number of ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memlm.config.run import compose
from memlm.train.trainer import Trainer


class RecordingLoader:
    """Wraps a loader: same batches and state methods, plus a copy of every input drawn."""

    def __init__(self, inner):
        self.inner = inner
        self.inputs: list[torch.Tensor] = []  # each (micro_batch, seq_len)

    def __iter__(self):
        return self

    def __next__(self):
        inputs, targets = next(self.inner)
        self.inputs.append(inputs.clone())
        return inputs, targets

    def __getattr__(self, name):  # state_dict, load_state_dict, ... of the wrapped loader
        return getattr(self.inner, name)


class RecordingTrainer(Trainer):
    def _default_loader(self, split: str):
        loader = super()._default_loader(split)
        return RecordingLoader(loader) if split == "train" else loader


def fit_recording(rank: int, overrides: list[str], out_dir: str) -> None:
    trainer = RecordingTrainer(compose(overrides))
    trainer.fit()
    torch.save(trainer.train_loader.inputs, Path(out_dir) / f"inputs_rank{rank}.pt")
