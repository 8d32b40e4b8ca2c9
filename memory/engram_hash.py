"""Engram's addressing: token ids -> the table rows each position reads, a pure function of
(seed, layer, tokens) and the sizes.

    hasher = NgramHash(token_map, max_order=3, heads=8, rows_per_head=[5 * 32000] * 2, seed=0, layer=1)
    rows = hasher(tokens)        # tokens (B, T) int64 -> rows (B, T, (max_order - 1) * heads) int64
    hasher.head_rows             # [p_{2,1}, ..., p_{N,K}]: each head's prime table size
    hasher.n_rows                # their sum: the rows of the one table (memory/engram.py)

The hash (docs/memory.md, "Engram"), for position t, order
n in 2..N and head k in 1..K, with canonical ids c = token_map[tokens]:

    c_s = pad = len(token_map) for s < 0           (left padding: above every canonical id)
    mix_n(t) = XOR_{i=0}^{n-1} (c_{t-i} * m_i)      (int64, exact: c < 2**31, m < 2**31)
    row(t, n, k) = offset_{n,k} + mix_n(t) mod p_{n,k}

m_i = layer_multipliers(seed, layer, N)[i] (odd, SplitMix64-derived); p_{n,k} the
K smallest primes >= rows_per_head[n-2] not taken by an earlier head of the
layer (head_primes); offset_{n,k} the sum of the earlier heads' primes. Column
j = (n - 2) * K + (k - 1) of `rows` is head (n, k).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15  # SplitMix64's increment
MULT_BITS = 30  # multipliers are 2 * r + 1 with r < 2**30, so m < 2**31
MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # exact Miller-Rabin below 3.3e24


def splitmix64(state: int) -> int:
    """The output of a SplitMix64 generator whose state is `state` (after its one step)."""
    z = (state + GOLDEN64) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def layer_multipliers(seed: int, layer: int, count: int) -> list[int]:
    """`count` odd multipliers < 2**31 for one layer:
    m_i = 2 * (splitmix64(splitmix64(splitmix64(seed) ^ layer) ^ i) >> 34) + 1."""
    base = splitmix64(splitmix64(seed & MASK64) ^ layer)
    return [2 * (splitmix64(base ^ i) >> (64 - MULT_BITS)) + 1 for i in range(count)]


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n below 3.3e24)."""
    if n < 2:
        return False
    for p in MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def head_primes(rows_per_head: Sequence[int], heads: int) -> list[list[int]]:
    """For each order's requested size M_n (orders 2..N in order), the K smallest primes >= M_n
    that no earlier head of the layer took: [[p_{2,1}, ..., p_{2,K}], ..., [p_{N,1}, ...]]."""
    taken: set[int] = set()
    out = []
    for size in rows_per_head:
        primes, candidate = [], size
        while len(primes) < heads:
            if candidate not in taken and is_prime(candidate):
                primes.append(candidate)
                taken.add(candidate)
            candidate += 1
        out.append(primes)
    return out


def ngram_hash(canon: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, pad: int) -> torch.Tensor:
    """canon (B, T) int64 canonical ids, multipliers (N,), primes (N - 1, K) int64 ->
    (B, T, (N - 1) * K) int64: each head's row in its own table (mix_n(t) mod p_{n,k}), no offsets."""
    n_max = multipliers.shape[0]
    seq = canon.shape[-1]
    padded = F.pad(canon, (n_max - 1, 0), value=pad)  # (B, T + N - 1): c_s, s from -(N-1)
    back = [padded[..., n_max - 1 - i: n_max - 1 - i + seq] for i in range(n_max)]  # back[i]: c_{t-i}, (B, T)
    mix = back[0] * multipliers[0]
    cols = []
    for n in range(2, n_max + 1):
        mix = mix ^ (back[n - 1] * multipliers[n - 1])  # mix_n(t), (B, T)
        cols.append(mix.unsqueeze(-1) % primes[n - 2])  # (B, T, K)
    return torch.cat(cols, dim=-1)


class NgramHash(nn.Module):
    """Token ids -> the global rows of the one Engram table (module docstring). Buffers only:
    `token_map` is saved with the model's state; the rest follows from the arguments."""

    def __init__(self, token_map: torch.Tensor, max_order: int, heads: int, rows_per_head: Sequence[int],
                 seed: int, layer: int):
        super().__init__()
        self.max_order, self.heads, self.seed, self.layer = max_order, heads, seed, layer
        self.rows_per_head = list(rows_per_head)  # the requested size of each order's tables
        self.vocab_size = int(token_map.numel())
        # Above every canonical id (they are < vocab_size), and a function of the shape alone: a model
        # built with any map hashes padding alike once a checkpoint's map is loaded into it.
        self.pad = self.vocab_size
        self.primes = head_primes(rows_per_head, heads)  # (N - 1) x K python ints
        self.head_rows = [p for order in self.primes for p in order]
        self.n_rows = sum(self.head_rows)
        self.multipliers = layer_multipliers(seed, layer, max_order)
        self._token_map = token_map.detach().to("cpu", torch.int64).clone()  # for init_buffers after to_empty
        self.register_buffer("token_map", torch.empty(self.vocab_size, dtype=torch.int64))
        self.register_buffer("mult", torch.empty(max_order, dtype=torch.int64), persistent=False)
        self.register_buffer("prime", torch.empty(max_order - 1, heads, dtype=torch.int64), persistent=False)
        self.register_buffer("offset", torch.empty(len(self.head_rows), dtype=torch.int64), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re-)fill the buffers from the arguments (at construction, and after `to_empty()`)."""
        offsets = [sum(self.head_rows[:j]) for j in range(len(self.head_rows))]
        self.token_map.copy_(self._token_map)
        self.mult.copy_(torch.tensor(self.multipliers, dtype=torch.int64))
        self.prime.copy_(torch.tensor(self.primes, dtype=torch.int64))
        self.offset.copy_(torch.tensor(offsets, dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> rows (B, T, (N - 1) * K) int64 into the concatenated table."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} and dtype {tokens.dtype} are invalid: "
                             "(batch, seq) integer token ids")
        self._check_tokens(tokens)
        canon = self.token_map[tokens.long()]  # (B, T)
        return ngram_hash(canon, self.mult, self.prime, self.pad) + self.offset

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        """Every id in [0, vocab_size). CPU: on the host, a ValueError naming the range. Elsewhere a
        device-side assertion (torch._assert_async): no sync in the step, as memlm.memory.fast.ops
        checks the reads' indices."""
        if tokens.numel() == 0:
            return
        lo, hi = torch.aminmax(tokens)
        if tokens.device.type != "cpu":
            torch._assert_async((lo >= 0) & (hi < self.vocab_size))
            return
        if not (0 <= int(lo) and int(hi) < self.vocab_size):
            raise ValueError(f"token ids in [{int(lo)}, {int(hi)}] are invalid: "
                             f"ids in [0, {self.vocab_size}) (the token map's vocab_size)")

    def extra_repr(self) -> str:
        return f"max_order={self.max_order}, heads={self.heads}, seed={self.seed}, layer={self.layer}, " \
               f"rows={self.n_rows}"
