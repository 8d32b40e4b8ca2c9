"""The trainer's data: the per-rank train and validation streams of `memlm.data`,
and their copy to the device.

    loader = build_train_loader(cfg, env)
    inputs, targets = to_device(next(loader), env.device)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from memlm.data.loader import build_loader
from memlm.errors import ConfigError


def build_train_loader(cfg: Any, env: Any, split: str = "train"):
    """This rank's loader: (inputs, targets) int64 CPU tensors of shape
    (micro_batch, seq_len), with state_dict() / load_state_dict(). (Ranks may
    build at once: the synthetic corpus is written under a file lock.)"""
    data = cfg.data
    if data.kind == "random":
        # Random tokens cover the model's vocabulary: nothing else defines it.
        data = dataclasses.replace(data, vocab_size=cfg.model.vocab_size)
    loader = build_loader(data, env.rank, env.world_size, split)
    if loader.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size", cfg.model.vocab_size,
            f"at least the data's vocabulary size {loader.vocab_size} (data.kind={cfg.data.kind})",
        )
    return loader


def has_validation(cfg: Any) -> bool:
    """Whether the data config holds out a validation stream."""
    return cfg.data.kind in ("random", "shards") or cfg.data.val_fraction > 0


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Copy a CPU batch to `device`. On CUDA from pinned memory with
    non_blocking=True: the copy is queued on the stream and the host goes on
    (a pageable copy makes the host wait for it). On CPU the tensors are
    returned as they are."""
    if device.type != "cuda":
        return tuple(t.to(device) for t in batch)
    return tuple(t.to(device, non_blocking=True) if t.is_pinned() else t.pin_memory().to(device, non_blocking=True)
                 for t in batch)
