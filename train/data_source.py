"""The trainer's data: the per-rank train and validation streams of `memlm.data`,
and their copy to the device.

    loader = build_train_loader(cfg, env)
    inputs, targets = to_device(next(loader), env.device)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from memlm.data.loader import build_loader
from memlm.errors import ConfigError

if TYPE_CHECKING:
    from memlm.config.run import Config
    from memlm.distributed.env import DistEnv


def build_train_loader(cfg: Config, env: DistEnv, split: str = "train"):
    """This rank's loader: (inputs, targets) int64 CPU tensors of shape
    (micro_batch, seq_len), with state_dict() / load_state_dict(); with
    model.doc_mask also each token's document id (inputs, targets, doc_ids).
    (Ranks may build at once: the synthetic corpus is written under a file lock.)"""
    data = cfg.data
    if data.kind == "random":
        # Random tokens cover the model's vocabulary: nothing else defines it.
        data = dataclasses.replace(data, vocab_size=cfg.model.vocab_size)
    loader = build_loader(data, env.rank, env.world_size, split, doc_ids=cfg.model.doc_mask)
    if loader.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size", cfg.model.vocab_size,
            f"at least the data's vocabulary size {loader.vocab_size} (data.kind={cfg.data.kind})",
        )
    return loader


def has_validation(cfg: Config) -> bool:
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


def model_batch(batch: tuple[torch.Tensor, ...], device: torch.device, doc_mask: bool):
    """A loader's batch on `device` as (inputs, targets, doc_ids): doc_ids (with
    model.doc_mask, from a loader built with doc_ids=True) or None."""
    if len(batch) != (3 if doc_mask else 2):
        want = "(inputs, targets, doc_ids)" if doc_mask else "(inputs, targets)"
        raise ConfigError("model.doc_mask", doc_mask, f"a setting that matches the loader's batches of "
                          f"{len(batch)} tensors: with this setting the trainer needs {want}")
    inputs, targets, *doc_ids = to_device(batch, device)
    return inputs, targets, (doc_ids[0] if doc_ids else None)
