"""Grouped-query causal self-attention through `scaled_dot_product_attention`
(or, with a document mask of packed rows, `memlm.model.doc_mask.attend`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memlm.model.args import ModelArgs
from memlm.model.doc_mask import attend
from memlm.model.kv_cache import KVCache
from memlm.model.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer_id: int = 0,
        doc_mask: Any = None,
    ) -> torch.Tensor:
        # x: (batch, seq, dim); cos/sin: (seq, head_dim), or (batch, 1, seq, head_dim) per row
        # (RoPE restart); doc_mask: from memlm.model.doc_mask.doc_attention_mask, no cache.
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer_id, k, v)
        gqa = self.n_kv_heads != self.n_heads
        if doc_mask is not None:
            out = attend(q, k, v, doc_mask, gqa)
        else:
            kv_len = k.shape[2]
            mask, causal = None, False
            if kv_len == seq:
                causal = seq > 1
            elif seq > 1:
                # New queries sit at the end of the cached sequence: query i sees keys <= offset + i.
                mask = torch.ones(seq, kv_len, dtype=torch.bool, device=x.device).tril(kv_len - seq)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def init_weights(self, init_std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std, a=-3 * out_std, b=3 * out_std)

    def flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token: the four projections, plus scores and weighted sum over
        the causal prefix (on average (seq_len + 1) / 2 keys per query)."""
        d_in = self.wq.in_features
        proj = 2 * d_in * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        proj += 2 * self.n_heads * self.head_dim * d_in
        # 2 matmuls (q.k and p.v) x 2 FLOPs x heads x head_dim x mean prefix length.
        attn = 2 * self.n_heads * self.head_dim * (seq_len + 1)
        return proj + attn

