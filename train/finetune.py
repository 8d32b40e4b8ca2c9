"""What a fine-tune trains (`finetune.mode`; docs/finetuning.md).

    python -m memlm.train finetune=memory init_from=runs/base/checkpoints/latest data=...
    python -m memlm.train finetune=sparse finetune.top_t=2000 init_from=... data=...

- full: every parameter (pretraining; a full fine-tune).
- memory: only the memory's value tables (memlm.memory.tables); every other
  parameter is frozen before the model is sharded: it gets no gradient, no
  optimizer state, and stays bitwise unchanged.
- sparse: as memory, and each step keeps the gradient of only the `top_t`
  rows of each table that its batch reads most above the background's reads
  (memory/slot_selection.py); the row-wise optimizers (SparseRowAdamW,
  SparseRowSGD) then touch those rows alone, moments and weight decay included.

The trainer's calls:

    freeze_for(model, cfg.finetune.mode)          # at build time, before sharding
    selection = SlotSelection(model, cfg, path)   # mode=sparse, once the model is sharded
    selection.start_step()                        # before the step's first forward
    selection.restrict_gradients()                # after the backward, before clipping

Under torchrun every rank counts its own batch's reads; one all-reduce per
table sums them, so every rank (and a one-process run on the same global
batch) selects the same rows, whatever memory_parallel shards the table over.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from memlm.errors import ConfigError
from memlm.hf.load import resolve_checkpoint_dir
from memlm.memory.slot_selection import restrict_table_grad_, slot_scores, top_slots
from memlm.memory.tables import sparse_tables
from memlm.train.slot_usage import FILE, StepReads, load_usage, memory_layers


def freeze_for(model: nn.Module, mode: str) -> None:
    """memory / sparse: every parameter but the sparse tables stops requiring a
    gradient; lora: every parameter (the adapters are added after)."""
    if mode == "full":
        return
    tables = {id(p) for p in sparse_tables(model)} if mode != "lora" else set()
    for p in model.parameters():
        if id(p) not in tables:
            p.requires_grad_(False)


def background_path(cfg) -> Path:
    """finetune.background, else slot_usage.safetensors in the init_from folder."""
    if cfg.finetune.background:
        return Path(cfg.finetune.background)
    if not cfg.init_from or cfg.init_from.startswith("hf:"):
        raise ConfigError("finetune.background", cfg.finetune.background,
                          f"the path of a slot-usage file (python -m memlm.train.slot_usage <checkpoint>); with "
                          f"init_from={cfg.init_from or '(empty)'} there is no checkpoint folder to find it in")
    return resolve_checkpoint_dir(cfg.init_from) / FILE


def check_background(cfg) -> None:
    """finetune=sparse: the background file exists (its layers are checked against the model when it loads)."""
    if cfg.finetune.mode != "sparse":
        return
    path = background_path(cfg)
    if not path.is_file():
        raise ConfigError("finetune.background", str(path), "a slot-usage file of the init_from model (write one: "
                          f"python -m memlm.train.slot_usage {cfg.init_from or '<checkpoint>'}); docs/finetuning.md")


class SlotSelection:
    """finetune=sparse: the rows each step may change, per value table."""

    def __init__(self, model: nn.Module, cfg, path: Path, distributed: bool):
        self.top_t, self.ranking, self.distributed = cfg.finetune.top_t, cfg.finetune.ranking, distributed
        self.layers = memory_layers(model)
        background = load_usage(path, {name: layer.usage.n_slots for name, layer in self.layers.items()})
        # One entry per table: a pool shared by several layers (Memory+) is ranked on their summed reads.
        tables: dict[int, tuple[torch.Tensor, list[str]]] = {}
        for name, layer in self.layers.items():
            tables.setdefault(id(layer.values.weight), (layer.values.weight, []))[1].append(name)
        device = next(iter(self.layers.values())).usage.counts.device
        self.tables = [(weight, names, sum(background[n] for n in names).to(device))
                       for weight, names in tables.values()]
        self._reads = StepReads(self.layers)

    def start_step(self) -> None:
        self._reads.start()

    def batch_counts(self, names: list[str]) -> torch.Tensor:
        """(N,) reads of one table's layers since start_step, summed over every rank's batch."""
        counts = sum(self._reads.since(n) for n in names)
        if self.distributed:
            dist.all_reduce(counts)
        return counts

    @torch.no_grad()
    def restrict_gradients(self) -> None:
        for weight, names, background in self.tables:
            counts = self.batch_counts(names)
            rows = top_slots(slot_scores(counts, background, self.ranking), counts, self.top_t)
            restrict_table_grad_(weight, rows)
