"""The model's Engram layers (memory/engram.py): which blocks get one, and what each is given.

    engram = build_engram(args, memory, layer_id, token_map)   # an Engram, or None for this block
    block = Block(args, layer_id, ffn, kind, engram)            # adds it to the residual stream first

Engram is no feed-forward kind: it adds `engram(h, rows)` to the block's input
before attention (docs/memory.md, "Engram in the model"), beside whatever FFN
kind the block holds. Its rows are a function of the tokens alone, so the
model computes every Engram layer's rows once per forward at its entry
(`Transformer.engram_rows`), or takes them computed ahead (`engram_rows=`).
"""

from __future__ import annotations

from typing import Any

import torch

from memlm.memory.engram import Engram
from memlm.model.args import ModelArgs


def engram_layers(memory: Any) -> list[int]:
    """The blocks that hold an Engram layer (memory.engram.layers), ascending; [] without a memory section."""
    engram = getattr(memory, "engram", None)
    return sorted(engram.layers) if engram is not None else []


def identity_map(vocab_size: int) -> torch.Tensor:
    """Every token id its own canonical id: (vocab_size,) int64 on the CPU (also under a meta device context)."""
    return torch.arange(vocab_size, dtype=torch.int64, device="cpu")


def build_engram(args: ModelArgs, memory: Any, layer_id: int, token_map: torch.Tensor | None) -> Engram | None:
    """Block `layer_id`'s Engram layer, or None; `token_map` (vocab_size,): canonical ids (None: the identity)."""
    if layer_id not in engram_layers(memory):
        return None
    cfg = memory.engram
    if token_map is None:
        token_map = identity_map(args.vocab_size)
    if token_map.shape != (args.vocab_size,):
        raise ValueError(f"token_map of shape {tuple(token_map.shape)} is invalid: one canonical id per token, "
                         f"({args.vocab_size},) for model.vocab_size={args.vocab_size}")
    return Engram(args.dim, token_map, layer=layer_id, seed=cfg.hash_seed, max_order=cfg.max_order,
                  heads=cfg.heads, head_dim=cfg.head_dim, rows_per_head=cfg.resolved_rows_per_head(args.vocab_size),
                  kernel_size=cfg.kernel_size, dilation=cfg.resolved_dilation(), sparse=memory.sparse_updates,
                  kernel=memory.kernel)
