"""Slot-usage health of memory layers, cheap enough to stay on.

Each memory layer counts, in training mode, how often each slot was read
since the last reset (one index_add of the step's H*knn slots per token; an
int64 counter per slot, 8 MB at 1M slots). `usage_metrics(model)` turns the
counters of every layer in any nn.Module tree into a flat dict and starts a
new window:

- usage: fraction of slots read at least once in the window (Lample et al.
  report 25.8% without and 80.3% with query BatchNorm at 1M slots);
- kl_uniform: KL(read distribution || uniform) in nats; 0 is perfectly even,
  log(N) is every read on one slot;
- top1pct_share: share of reads taken by the 1% most-read slots (0.01 when even);
- reads: reads counted in the window (tokens * heads * knn).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


class SlotUsage(nn.Module):
    """Per-slot read counter of one layer over a window of steps."""

    def __init__(self, n_slots: int):
        super().__init__()
        self.n_slots = n_slots
        # Not persistent: a window's statistics are logging state, not model state.
        self.register_buffer("counts", torch.zeros(n_slots, dtype=torch.long), persistent=False)

    @torch.no_grad()
    def record(self, slots: torch.Tensor) -> None:
        """slots: any shape, int64 slot indices read in this step.

        One in-place index_add on a buffer, no host value: torch.compile
        traces it into the layer's graph (a buffer mutation) without a break."""
        flat = slots.reshape(-1)
        # An expanded scalar: no per-read allocation of ones.
        self.counts.index_add_(0, flat, torch.ones((), dtype=torch.long, device=flat.device).expand_as(flat))

    @torch.no_grad()
    def reset(self) -> None:
        self.counts.zero_()

    @torch.no_grad()
    def metrics(self, counts: torch.Tensor | None = None) -> dict[str, float]:
        """The window's metrics (see the module docstring); {} when nothing was read."""
        counts = self.counts if counts is None else counts
        total = int(counts.sum())
        if total == 0:
            return {}
        n = self.n_slots
        read = counts[counts > 0].double()
        p = read / total
        kl = float((p * (p.log() + math.log(n))).sum())
        top = max(1, n // 100)
        top_share = float(counts.topk(min(top, n)).values.sum()) / total
        return {
            "usage": read.numel() / n,
            "kl_uniform": max(kl, 0.0),  # rounding can give -1e-16 for an even spread
            "top1pct_share": top_share,
            "reads": float(total),
        }


def usage_name(module: nn.Module, path: str = "") -> str:
    """What a memory layer's counters are called (metrics, background files): its `usage_name`
    (an Engram layer: "engram1"), else `layer{layer_id}` (memlm's Transformer sets it), else `path`."""
    name = getattr(module, "usage_name", None)
    if name:
        return name
    layer_id = getattr(module, "layer_id", None)
    return f"layer{layer_id}" if layer_id is not None else (path or "root")


def usage_metrics(
    model: nn.Module,
    reset: bool = True,
    prefix: str = "memory",
    reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> dict[str, float]:
    """Flat metrics of every memory layer in `model`, e.g.
    {"memory/layer4/usage": 0.81, "memory/layer4/kl_uniform": 0.3, ...}.

    A layer is named by `usage_name` (its layer_id, or its module path). `reset` starts a new window.
    `reduce`, if given, is applied to a copy of each counter first, e.g.
    `lambda t: dist.all_reduce(t)` to merge the data-parallel ranks' windows
    (it may work in place and return None, or return the reduced tensor)."""
    out: dict[str, float] = {}
    for path, module in model.named_modules():
        usage = getattr(module, "usage", None)
        if not isinstance(usage, SlotUsage):
            continue
        name = usage_name(module, path)
        counts = usage.counts
        if reduce is not None:
            counts = counts.clone()
            reduced = reduce(counts)
            counts = counts if reduced is None else reduced
        for key, value in usage.metrics(counts).items():
            out[f"{prefix}/{name}/{key}"] = value
        if reset:
            usage.reset()
    return out


def reset_usage(model: nn.Module) -> None:
    """Start a new window in every memory layer of `model` without reading it."""
    for module in model.modules():
        if isinstance(module, SlotUsage):
            module.reset()
