"""finetune=sparse: which rows of each value table a step may change (and of every table read
at the same rows: UltraMemV2's pre-values).

    hook = SlotSelection(model, cfg, background_path, distributed)   # once the model is sharded
    hook.describe()         # the run's start line: the background file it ranks against
    hook.step_start(step)   # before the step's first forward
    hook.after_backward()   # after the backward, before clipping: only the selected rows keep a gradient

Each step ranks the slots its batch read against the background's reads
(memory/slot_selection.py: KL or TF-IDF) and keeps the gradient of the
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

from memlm.finetune.background import StepReads, load_usage, memory_layers, usage_metadata, value_tables
from memlm.memory.slot_selection import restrict_table_grad_, slot_scores, top_slots


class SlotSelection:
    def __init__(self, model: nn.Module, cfg, path: Path, distributed: bool):
        self.top_t, self.ranking, self.distributed = cfg.finetune.top_t, cfg.finetune.ranking, distributed
        self.layers = memory_layers(model)
        self.path = Path(path)
        background = load_usage(path, {name: layer.usage.n_slots for name, layer in self.layers.items()})
        # One entry per table: a pool shared by several layers (Memory+) is ranked on their summed reads.
        device = next(iter(self.layers.values())).usage.counts.device
        self.tables = [(self.layers[names[0]].row_tables(), names, sum(background[n] for n in names).to(device))
                       for names in value_tables(self.layers).values()]
        self._reads = StepReads(self.layers)

    def describe(self) -> str:
        """The line a run prints at its start: which background file ranks the slots, and what it counted."""
        meta = usage_metadata(self.path)
        counted = f" ({int(meta['tokens']):,} tokens through {meta['source']})" if meta else ""
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
            rows = top_slots(slot_scores(counts, background, self.ranking), counts, self.top_t)
            for weight in weights:  # the same rows of every table the slots address
                restrict_table_grad_(weight, rows)
