"""Rotary position embeddings in the "rotate half" layout.

The two halves of each head's channels form the (real, imaginary) pairs. This
is the layout Hugging Face's Llama uses, so q/k projection weights map to and
from `transformers` without any permutation.
"""

from __future__ import annotations

import torch


def rope_cos_sin(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim), in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # (seq, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (seq, head_dim)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim) for x's positions, or
    (batch, 1, seq, head_dim) when each row has its own positions (RoPE restart per document)."""
    xf = x.float()
    out = xf * cos + _rotate_half(xf) * sin
    return out.to(x.dtype)
