"""memlm's MoE and PEER feed-forwards in transformers (trust_remote_code): torch only.

Copied verbatim into every non-dense export beside modeling_memlm.py, which builds one per
block of that kind (config.json's `layer_ffn_kinds`):

    ffn = MoE(config.hidden_size, config.memory)    # top-k routed SwiGLU experts (memlm model/moe.py)
    ffn = PEER(config.hidden_size, config.memory)   # single-neuron experts by product keys (model/peer.py)
    out = ffn(x)                                    # x (batch, seq, dim) -> (batch, seq, dim)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers_memlm import ACTIVATIONS, full_precision, product_key_topk, row_dots


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, gates renormalized over the top_k (memlm model/moe.py)."""

    def __init__(self, dim: int, m: dict):
        super().__init__()
        n, hidden = m["n_experts"], m["expert_hidden_dim"]
        self.dim, self.n_experts, self.top_k = dim, n, m["top_k"]
        self.router = nn.Linear(dim, n, bias=False)
        self.w1 = nn.Parameter(torch.zeros(n, dim, hidden))
        self.w3 = nn.Parameter(torch.zeros(n, dim, hidden))
        self.w2 = nn.Parameter(torch.zeros(n, hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        compute = torch.promote_types(x.dtype, torch.float32)
        with full_precision(x.device):
            probs = F.linear(x.to(compute), self.router.weight.to(compute)).softmax(dim=-1)  # (T, E)
            top_p, experts = probs.topk(self.top_k, dim=-1)  # (T, k)
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.n_experts):  # experts in order: each token's outputs are summed as memlm sums them
            tok, k = (experts == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = F.silu(x[tok] @ self.w1[e]) * (x[tok] @ self.w3[e])  # (n_e, hidden)
            out.index_add_(0, tok, (h @ self.w2[e]) * gates[tok, k].unsqueeze(-1).to(x.dtype))
        return out.reshape(shape)


class ExpertTable(nn.Module):
    def __init__(self, n_experts: int, dim: int):
        super().__init__()
        self.down = nn.Parameter(torch.zeros(n_experts, dim))  # u: (N, dim)
        self.up = nn.Parameter(torch.zeros(n_experts, dim))  # v: (N, dim)


class PEER(nn.Module):
    """Product-key retrieval of single-neuron experts (memlm model/peer.py)."""

    def __init__(self, dim: int, m: dict):
        super().__init__()
        self.dim, self.n_keys, self.heads, self.knn, self.k_dim = dim, m["n_keys"], m["heads"], m["knn"], m["k_dim"]
        self.query_norm, self.activation = m["qk_norm"], m["peer_activation"]
        self.query = nn.Linear(dim, self.heads * self.k_dim, bias=False)
        self.keys = nn.Parameter(torch.zeros(2, self.n_keys, self.k_dim // 2))  # shared by the heads
        self.experts = ExpertTable(self.n_keys**2, dim)

    def retrieve(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> weights (T, H, knn) float32+, expert indices (T, H, knn).

        As memlm's PEER: the query projection too in float32 (or wider) with
        autocast off, so the selection is the float32 model's."""
        weight = self.query.weight  # (H * k_dim, dim)
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        with full_precision(x.device):
            q = F.linear(x.to(compute), weight.to(compute)).view(-1, self.heads, 2, self.k_dim // 2)
            if self.query_norm:
                q = F.rms_norm(q, (self.k_dim // 2,))
            sub = torch.einsum("thcd,cnd->thcn", q, self.keys.to(compute))  # (T, H, 2, n_keys)
            scores, idx = product_key_topk(sub, self.knn)
            return scores.softmax(dim=-1), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        weights, idx = self.retrieve(x)  # (T, H, knn) each
        idx = idx.flatten(1)  # (T, H*knn)
        # u_i . x of each retrieved expert; the (T, H*knn, dim) gather is fine at inference.
        hidden = ACTIVATIONS[self.activation](row_dots(self.experts.down, idx, x))  # (T, H*knn)
        coef = weights.flatten(1).to(x.dtype) * hidden  # (T, H*knn)
        out = F.embedding_bag(idx, self.experts.up, per_sample_weights=coef, mode="sum")
        return out.reshape(shape)
