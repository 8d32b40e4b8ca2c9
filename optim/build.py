"""Optimizer, parameter groups and learning-rate schedules (clipping: distributed/clip.py).

The tables' clip is taken in the optimizer's step (memlm.memory.table_grads):
every optimizer built here applies the value group's clip coefficient.

Groups: weights with decay; norms, biases and other vectors without decay;
the sparse tables (memlm.memory.tables: value pools and PEER's expert tables)
with their own fixed base lr, weight decay and gradient-norm clip. The
schedule multiplier applies to every group.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from memlm.config.run import Config, OptimConfig
from memlm.finetune.modes import mode_of
from memlm.memory.table_adamw import TableAdamW
from memlm.memory.table_grads import TABLES
from memlm.memory.tables import sparse_tables
from memlm.model import memory_family


def param_groups(model: nn.Module, cfg: Config) -> list[dict]:
    values = {id(p) for p in sparse_tables(model)}
    decay, no_decay, value = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in values:
            value.append(p)
        elif p.ndim < 2 or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"name": "decay", "params": decay, "lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay},
        {"name": "no_decay", "params": no_decay, "lr": cfg.optim.lr, "weight_decay": 0.0},
    ]
    if value:
        groups.append({
            "name": "memory_values", "params": value, "lr": cfg.memory.value_lr,
            "weight_decay": cfg.memory.value_weight_decay, "max_grad_norm": cfg.memory.value_grad_clip,
        })
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; with memory.sparse_updates the lazy row-wise AdamW, which applies
    exact AdamW to dense gradients and touches only the rows read for the
    tables' sparse gradients (see memlm.memory.sparse_adamw for the trade-off).
    With memory.value_dtype=bf16 that optimizer too: it keeps float32 moments
    for the bf16 table (torch's AdamW would keep them in bf16).
    finetune=memory/sparse: only the value group (the rest is frozen), with
    finetune.optimizer; sparse gradients hold the selected rows, so the
    row-wise optimizers touch those rows alone (memlm.finetune.modes)."""
    o = cfg.optim
    groups = param_groups(model, cfg)
    fam = memory_family(cfg.memory)
    has_tables = fam is not None or bool(cfg.memory.engram.layers)
    sparse = (cfg.memory.sparse_updates or mode_of(cfg).row_gradients) and has_tables
    for group in groups:
        if group["name"] == "memory_values":
            # Dense reads: one gradient buffer per table, accumulated into by
            # every read and kept between steps (memlm.memory.table_grads).
            group[TABLES] = not sparse
    if cfg.finetune.optimizer == "sgd":
        from memlm.memory.sparse_sgd import SparseRowSGD

        return SparseRowSGD(groups, lr=cfg.memory.value_lr, weight_decay=cfg.memory.value_weight_decay)
    low_precision_values = cfg.memory.value_dtype != "fp32" and fam is not None and fam.reads_rows
    if sparse or low_precision_values:
        from memlm.memory.sparse_adamw import SparseRowAdamW

        return SparseRowAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    # torch's AdamW, fused on every device and for DTensor (sharded) parameters
    # too: it is the implementation that honours `found_inf`, which skips a
    # non-finite step on the device (train/step_guard.py), and it is much
    # faster on CPU as well. The table group's step folds in its clip and
    # zeroes its buffer (memlm.memory.table_adamw).
    return TableAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def lr_multiplier(step: int, total: int, o: OptimConfig) -> float:
    """Schedule factor for optimizer step `step` (0-based) of `total`."""
    if o.warmup and step < o.warmup:
        return (step + 1) / o.warmup
    if o.schedule == "constant" or total <= o.warmup:
        return 1.0
    if o.schedule == "wsd":
        decay_steps = max(1, int(round(o.decay_fraction * (total - o.warmup))))
        decay_start = total - decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return 1.0 - (1.0 - o.min_lr_ratio) * progress
    progress = min(1.0, (step - o.warmup + 1) / (total - o.warmup))
    if o.schedule == "linear":
        return 1.0 - (1.0 - o.min_lr_ratio) * progress
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg.steps, cfg.optim))
