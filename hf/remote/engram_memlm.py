"""memlm's Engram layer in Hugging Face transformers (trust_remote_code): torch only.

Copied verbatim into every export whose model has Engram layers, beside
modeling_memlm.py, which builds one per block of config.engram["layers"]:

    engram = Engram(config.hidden_size, config.vocab_size, config.engram, layer_id)
    h = h + engram(h, canon, history)   # canon (B, T): canonical ids, padding already the pad id

The math is memlm's (memory/engram.py, memory/engram_hash.py) restated in
plain PyTorch, with the same parameter names (engram.tables.weight, w_k, w_v,
norm_k, norm_h, norm_c, conv, hash.token_map), so the export's safetensors
load unchanged. The multipliers are the SplitMix64 function of (hash_seed,
layer) and the primes come from config.json (`engram.head_rows`): no buffer
beyond the token map, which the weights carry.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MASK64 = (1 << 64) - 1
SSQRT_EPS = 1e-6  # memlm.memory.engram.SSQRT_EPS


def splitmix64(state: int) -> int:
    z = (state + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def layer_multipliers(seed: int, layer: int, count: int) -> list[int]:
    base = splitmix64(splitmix64(seed & MASK64) ^ layer)
    return [2 * (splitmix64(base ^ i) >> 34) + 1 for i in range(count)]


class EngramHash(nn.Module):
    """The token map (a buffer the weights carry) and the hash of canonical ids into table rows."""

    def __init__(self, vocab_size: int, e: dict, layer: int):
        super().__init__()
        self.register_buffer("token_map", torch.zeros(vocab_size, dtype=torch.int64))
        self.pad = vocab_size  # above every canonical id
        self.mults = layer_multipliers(e["hash_seed"], layer, e["max_order"])
        self.primes = [list(order) for order in e["head_rows"]]  # (max_order - 1) x heads
        flat = [p for order in self.primes for p in order]
        self.offsets = [sum(flat[:j]) for j in range(len(flat))]

    def canonical(self, input_ids: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """input_ids (B, T) -> canonical ids (B, T); positions where `real` is False hash as padding."""
        canon = self.token_map[input_ids]
        return canon if real is None else canon.masked_fill(~real, self.pad)

    def forward(self, canon: torch.Tensor) -> torch.Tensor:
        """canon (B, T) -> rows (B, T, H): memlm.memory.engram_hash.ngram_hash plus each head's offset."""
        dev = canon.device
        mult = torch.tensor(self.mults, dtype=torch.int64, device=dev)
        prime = torch.tensor(self.primes, dtype=torch.int64, device=dev)
        n_max, seq = len(self.mults), canon.shape[-1]
        padded = F.pad(canon, (n_max - 1, 0), value=self.pad)
        back = [padded[..., n_max - 1 - i: n_max - 1 - i + seq] for i in range(n_max)]
        mix = back[0] * mult[0]
        cols = []
        for n in range(2, n_max + 1):
            mix = mix ^ (back[n - 1] * mult[n - 1])
            cols.append(mix.unsqueeze(-1) % prime[n - 2])
        return torch.cat(cols, dim=-1) + torch.tensor(self.offsets, dtype=torch.int64, device=dev)


class EngramTables(nn.Module):
    def __init__(self, n_rows: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_rows, head_dim))


class Engram(nn.Module):
    """memlm.memory.engram.Engram: the gated n-gram memory, its output added before the block's attention."""

    def __init__(self, dim: int, vocab_size: int, e: dict, layer: int):
        super().__init__()
        self.dim, self.kernel_size, self.dilation = dim, e["kernel_size"], e["dilation"]
        self.max_order = e["max_order"]
        self.hash = EngramHash(vocab_size, e, layer)
        n_heads = sum(len(order) for order in e["head_rows"])
        self.tables = EngramTables(sum(p for order in e["head_rows"] for p in order), e["head_dim"])
        self.w_k = nn.Linear(n_heads * e["head_dim"], dim, bias=False)
        self.w_v = nn.Linear(n_heads * e["head_dim"], dim, bias=False)
        self.norm_k = nn.Parameter(torch.ones(dim))
        self.norm_h = nn.Parameter(torch.ones(dim))
        self.norm_c = nn.Parameter(torch.ones(dim))
        self.conv = nn.Parameter(torch.zeros(dim, self.kernel_size))

    def forward(self, h: torch.Tensor, canon: torch.Tensor, real: torch.Tensor | None,
                history: dict | None) -> torch.Tensor:
        """h (B, T, dim), canon (B, T) -> y (B, T, dim). `real` (B, T): False at padding (its conv input
        is zero, as before a row's first token). `history`: what earlier calls of a cached decode left
        (this layer's canonical ids and conv inputs), extended here."""
        past_canon = history["canon"] if history else canon[:, :0]
        first = max(0, past_canon.shape[1] - (self.max_order - 1))
        window = torch.cat([past_canon[:, first:], canon], dim=1)
        rows = self.hash(window)[:, window.shape[1] - canon.shape[1]:]
        e = F.embedding(rows, self.tables.weight).flatten(-2)  # (B, T, E)
        k, v = self.w_k(e), self.w_v(e)
        eps = torch.finfo(h.dtype).eps
        dot = (F.rms_norm(k, (self.dim,), self.norm_k, eps) * F.rms_norm(h, (self.dim,), self.norm_h, eps)).sum(-1)
        s = dot / math.sqrt(self.dim)
        gate = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs().clamp_min(SSQRT_EPS)))  # the signed square root
        u = gate.unsqueeze(-1) * v
        conv_in = F.rms_norm(u, (self.dim,), self.norm_c, eps)
        if real is not None:
            conv_in = conv_in.masked_fill(~real.unsqueeze(-1), 0.0)
        past_in = history["conv_in"] if history else conv_in[:, :0]
        reach = (self.kernel_size - 1) * self.dilation
        start = max(0, past_in.shape[1] - reach)
        x = torch.cat([past_in[:, start:], conv_in], dim=1)
        if history is not None:
            history["canon"] = torch.cat([past_canon, canon], dim=1)
            history["conv_in"] = torch.cat([past_in, conv_in], dim=1)
        seq = x.shape[1]
        out = None
        for j in range(self.kernel_size):  # tap 0 first: memlm's order
            back = (self.kernel_size - 1 - j) * self.dilation
            shifted = F.pad(x, (0, 0, back, 0))[:, :seq] if back else x
            term = self.conv[:, j] * shifted
            out = term if out is None else out + term
        return u + F.silu(out[:, seq - conv_in.shape[1]:])
