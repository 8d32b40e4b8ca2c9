"""Engram's math in plain PyTorch, written the long way: the oracle for memory/engram.py.

    y = engram_reference(layer, h, tokens)   # an Engram layer, h (B, T, dim), tokens (B, T) -> y (B, T, dim)
    rows = reference_rows(layer, tokens)     # (B, T, H) int64: the table row of each position and head

From the paper's equations, step by step (docs/memory.md, "Engram"):

    c_t = token_map[x_t]; c_t = pad for t < 0              canonical ids, left padding
    z_{t,n,k} = (XOR_{i<n} c_{t-i} * m_i) mod p_{n,k}       Python integers, position by position
    e_t = concat_{n,k} E_{n,k}[z_{t,n,k}]                   each head's own table E_{n,k} (a slice of the one)
    k_t = W_k e_t; v_t = W_v e_t
    a_t = sigmoid(ssqrt(RMSNorm(k_t) . RMSNorm(h_t) / sqrt(dim)))
    u_t = a_t v_t
    y_t = u_t + SiLU(sum_j w_j * RMSNorm(u)_{t - (w-1-j) dil})   (terms before position 0 are 0)

The primes are found by trial division here, the multipliers are the
documented memlm.memory.engram_hash.layer_multipliers (its SplitMix64 is
checked against published test vectors). Each float step is the same torch
operation, on the same shapes, as the layer's (a matmul over all positions, a
gather per head, one multiply-add per convolution tap), so the two agree
bit for bit in float32, gradients included (tests/unit/test_engram.py); a
per-position loop would sum in another order.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memlm.memory.engram_hash import layer_multipliers


def prime_at_least(start: int, taken: set[int]) -> int:
    """The smallest prime >= start not in `taken` (trial division)."""
    p = max(start, 2)
    while p in taken or any(p % d == 0 for d in range(2, math.isqrt(p) + 1)):
        p += 1
    return p


def reference_primes(rows_per_head: list[int], heads: int) -> list[list[int]]:
    """Order by order, head by head: each head's table size, a prime no earlier head took."""
    taken: set[int] = set()
    out = []
    for size in rows_per_head:
        order = []
        for _ in range(heads):
            p = prime_at_least(size if not order else order[-1] + 1, taken)
            taken.add(p)
            order.append(p)
        out.append(order)
    return out


def reference_rows(layer: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B, T) -> (B, T, H) int64: offset of head (n, k) + z_{t,n,k}, by Python integer arithmetic."""
    hasher = layer.hash
    token_map = hasher.token_map.tolist()
    pad = len(token_map)
    n_max = hasher.max_order
    mult = layer_multipliers(hasher.seed, hasher.layer, n_max)
    primes = [p for order in reference_primes(hasher.rows_per_head, hasher.heads) for p in order]
    offsets = [sum(primes[:j]) for j in range(len(primes))]
    out = []
    for seq in tokens.tolist():
        canon = [token_map[x] for x in seq]
        seq_rows = []
        for t in range(len(seq)):
            pos_rows = []
            for n in range(2, n_max + 1):
                mix = 0
                for i in range(n):
                    mix ^= (canon[t - i] if t - i >= 0 else pad) * mult[i]
                for k in range(hasher.heads):
                    j = (n - 2) * hasher.heads + k
                    pos_rows.append(offsets[j] + mix % primes[j])
            seq_rows.append(pos_rows)
        out.append(seq_rows)
    return torch.tensor(out, dtype=torch.int64).reshape(*tokens.shape, len(primes))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(mean(x**2) + eps) * weight over the last dim (eps: the dtype's)."""
    eps = torch.finfo(x.dtype).eps
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def memory_vector(layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """rows (B, T, H) -> e (B, T, H * head_dim): head j reads its own table E_j = table[offset_j : offset_j + p_j]."""
    table = layer.tables.weight
    parts, start = [], 0
    for j, size in enumerate(layer.hash.head_rows):
        head_table = table[start:start + size]  # (p_j, head_dim)
        parts.append(head_table[rows[..., j] - start])  # (B, T, head_dim)
        start += size
    return torch.cat(parts, dim=-1)


def causal_conv(x: torch.Tensor, taps: torch.Tensor, dilation: int) -> torch.Tensor:
    """x (B, T, C), taps (C, w) -> (B, T, C): out_t = sum_j taps[:, j] * x_{t - (w-1-j) dil}, x_s = 0 for s < 0."""
    seq, width = x.shape[1], taps.shape[1]
    out = None
    for j in range(width):
        back = (width - 1 - j) * dilation
        tap_in = torch.stack([x[:, t - back] if t >= back else torch.zeros_like(x[:, 0]) for t in range(seq)], dim=1)
        term = taps[:, j] * tap_in
        out = term if out is None else out + term
    return out


def engram_reference(layer: nn.Module, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The layer's output by the equations above, from its own parameters. h (B, T, dim) -> (B, T, dim)."""
    e = memory_vector(layer, reference_rows(layer, tokens).to(h.device))  # (B, T, E)
    k = e @ layer.w_k.weight.t()  # (B, T, dim)
    v = e @ layer.w_v.weight.t()
    dot = (rms_norm(k, layer.norm_k) * rms_norm(h, layer.norm_h)).sum(dim=-1) / math.sqrt(h.shape[-1])
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))  # (B, T)
    u = gate.unsqueeze(-1) * v
    return u + torch.nn.functional.silu(causal_conv(rms_norm(u, layer.norm_c), layer.conv, layer.dilation))
