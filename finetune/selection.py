"""finetune=sparse: which rows of each value table a step may change (and of every table read
at the same rows: UltraMemV2's pre-values).

    hook = SlotSelection(model, cfg, background_path, distributed)   # once the model is sharded
    hook.describe()         # the run's start line: the background file it ranks against
    hook.step_start(step)   # before the step's first forward
    hook.after_backward()   # after the backward, before clipping: only the selected rows keep a gradient

Each step ranks the slots its batch read against the background's reads
(memory/slot_selection.py: KL, TF-IDF, or Lin et al.'s TF-IDF over background
batches) and keeps the gradient of the
`top_t` best of each table. Under torchrun every rank counts its own batch's
reads; one all-reduce per table sums them, so every rank (and a one-process
run on the same global batch) selects the same rows, whatever memory_parallel
shards the table over.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from memlm.finetune.background import (
    StepReads,
    load_batches_read,
    load_usage,
    memory_layers,
    usage_metadata,
    value_tables,
)
from memlm.memory.slot_selection import BY_BATCHES, restrict_table_grad_, slot_scores, top_slots


class SlotSelection:
    def __init__(self, model: nn.Module, cfg, path: Path, distributed: bool):
        self.top_t, self.ranking, self.distributed = cfg.finetune.top_t, cfg.finetune.ranking, distributed
        self.layers = memory_layers(model)
        self.path = Path(path)
        background = load_usage(path, {name: layer.usage.n_slots for name, layer in self.layers.items()})
        tables = value_tables(self.layers)
        self.n_batches = 0
        if self.ranking in BY_BATCHES:  # the background is how many of its batches read each slot
            by_table, self.n_batches = load_batches_read(path, list(tables))
        else:  # one entry per table: a pool shared by several layers (Memory+) is ranked on their summed reads
            by_table = {label: sum(background[n] for n in names) for label, names in tables.items()}
        device = next(iter(self.layers.values())).usage.counts.device
        self.tables = [(self.layers[names[0]].row_tables(), names, by_table[label].to(device))
                       for label, names in tables.items()]
        self._reads = StepReads(self.layers)

    def describe(self) -> str:
        """The line a run prints at its start: which background file ranks the slots, and what it counted."""
        meta = usage_metadata(self.path)
        counted = f" ({int(meta['tokens']):,} tokens through {meta['source']})" if meta else ""
        if self.n_batches:  # the documents a ranking by batches counts in, against this run's batches
            counted += f", {self.n_batches:,} background batches of {int(meta['batch_tokens']):,} tokens"
        return (f"finetune=sparse: background slot usage from {self.path}{counted}, "
                f"top_t {self.top_t:,} by {self.ranking}")

    def step_start(self, step: int) -> None:
        self._reads.start()

    def batch_counts(self, names: list[str]) -> torch.Tensor:
        """(N,) reads of one table's layers since step_start, summed over every rank's batch."""
        counts = sum(self._reads.since(n) for n in names)
        if self.distributed:
            dist.all_reduce(counts)
        return counts

    @torch.no_grad()
    def after_backward(self) -> None:
        for weights, names, background in self.tables:
            counts = self.batch_counts(names)
            rows = top_slots(slot_scores(counts, background, self.ranking, self.n_batches), counts, self.top_t)
            for weight in weights:  # the same rows of every table the slots address
                restrict_table_grad_(weight, rows)
