"""Key/value cache for incremental decoding.

One preallocated buffer per layer; `Transformer.forward(tokens, cache=...)`
writes the new positions and advances `cache.pos` once all layers have run.
Without a dtype the buffers are allocated at the first write, in the dtype
the attention computes in: float32 for a plain model, bfloat16 under autocast
or an FSDP mixed-precision policy (whose sharded parameters stay float32, so
their dtype says nothing about the keys). `layer_states` holds other layers'
decoding state (Engram's), written at `pos` like the keys.
"""

from __future__ import annotations

from typing import Any

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        layer_states: dict[int, Any] | None = None,
    ):
        # Other per-layer decoding state, by block index (an Engram layer's tokens and conv inputs,
        # memlm.memory.engram.EngramState), kept by position like the keys: reset() starts them over too.
        self.layer_states = layer_states or {}
        self.shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.device = device
        self.k = self.v = None
        if dtype is not None:
            self._allocate(dtype)
        self.max_len = max_len
        self.pos = 0  # positions already stored (identical for every layer)

    def _allocate(self, dtype: torch.dtype) -> None:
        self.k = torch.zeros(self.shape, device=self.device, dtype=dtype)
        self.v = torch.zeros(self.shape, device=self.device, dtype=dtype)

    @property
    def batch(self) -> int:
        return self.shape[1]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (batch, kv_heads, new, head_dim) after `pos`; return all keys/values so far."""
        if self.k is None:
            self._allocate(k.dtype)
        end = self.pos + k.shape[2]
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        self.pos = 0
