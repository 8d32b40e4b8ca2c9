"""A pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

With an Engram layer (memlm.model.engram_slot), x = x + engram(x, ...) comes first."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from memlm.model.args import ModelArgs
from memlm.model.attention import Attention
from memlm.model.kv_cache import KVCache
from memlm.model.norms import RMSNorm


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, feed_forward: nn.Module, ffn_kind: str,
                 engram: nn.Module | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.ffn_kind = ffn_kind
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward
        self.engram = engram  # None, or an Engram adding to the residual stream before attention
        # Depth-scaled init of the projections that write into the residual stream.
        depth_scale = math.sqrt(2 * (layer_id + 1)) if args.depth_init else 1.0
        self._init_std = args.init_std
        self._out_std = args.init_std / depth_scale

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
        doc_mask: Any = None, engram_in: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        # x: (batch, seq, dim); doc_mask: see memlm.model.doc_mask (packed rows, no cache);
        # engram_in: the Engram layer's keyword arguments (rows=, or tokens= with a decoding state=, start=)
        if self.engram is not None:
            x = x + self.engram(x, **engram_in)
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, self.layer_id, doc_mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self._init_std, self._out_std)
        self.feed_forward.init_weights(self._init_std, self._out_std)
        if self.engram is not None:
            self.engram.init_weights()
