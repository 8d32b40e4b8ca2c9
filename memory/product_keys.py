"""Product-key lookup: which value slots a token reads, and with what weight.

N = n_keys**2 slots; slot (i, j) has key [k1_i ; k2_j], so its score against a
query [q1 ; q2] is s1[i] + s2[j]. The top-k of all N sums is found exactly at
sqrt(N) cost: a pair in the overall top-k has each half in its own half's
top-k, so scoring the k*k candidates built from the two half top-k's suffices
(Lample et al. 2019; MEMORY_LAYERS.md section 1).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from memlm.errors import ConfigError


def subkey_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query (T, H, 2, half), keys (H, 2, n_keys, half) -> scores (T, H, 2, n_keys)."""
    return torch.einsum("thcd,hcnd->thcn", query, keys)


@functools.lru_cache(maxsize=64)
def _candidate_pairs(knn: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks (a, b) in the two sorted top-k lists with (a + 1) * (b + 1) <= knn.

    With both lists sorted descending, s1[a] + s2[b] is at most each of the
    (a + 1) * (b + 1) sums s1[a'] + s2[b'] with a' <= a, b' <= b; if that count
    exceeds knn, knn other candidates are at least as good and (a, b) cannot
    be needed. That leaves about knn * ln(knn) candidates instead of knn**2
    (119 instead of 1024 for knn = 32). Built on the host once per (knn,
    device): a read-only memo, no host sync on the hot path."""
    pairs = [(a, b) for a in range(knn) for b in range(knn) if (a + 1) * (b + 1) <= knn]
    ranks = torch.tensor(pairs, dtype=torch.long).t().contiguous()
    return ranks[0].to(device), ranks[1].to(device)


def product_key_topk(sub_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-`knn` of s1[i] + s2[j] over all n_keys**2 slots, per token and head
    (ties aside: among equal sums any may be kept).

    sub_scores: (T, H, 2, n_keys) -> scores (T, H, knn) descending, slots
    (T, H, knn) int64 with slot = i * n_keys + j."""
    n_keys = sub_scores.shape[-1]
    # One top-k over both halves (not one per slice): its backward then builds
    # one zero-filled (T, H, 2, n_keys) gradient instead of three. Sorted, so
    # only the pairs of _candidate_pairs can reach the final top-k.
    half_scores, half_idx = sub_scores.topk(knn, dim=-1)  # (T, H, 2, knn)
    s1, s2 = half_scores.unbind(2)  # (T, H, knn) each
    i1, i2 = half_idx.unbind(2)
    a, b = _candidate_pairs(knn, sub_scores.device)
    lead = s1.shape[:-1]

    def pick(x: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        # On a 2-D contiguous tensor, index_select along dim 1 is ~15x faster
        # on CPU than along the last dim of the strided (T, H, knn) view.
        return x.reshape(-1, knn).index_select(1, ranks).view(*lead, -1)

    cand = pick(s1, a) + pick(s2, b)  # (T, H, ~knn ln knn)
    cand_slots = pick(i1, a) * n_keys + pick(i2, b)
    scores, best = cand.topk(knn, dim=-1)  # (T, H, knn)
    return scores, cand_slots.gather(-1, best)


def balance_loss(sub_scores: torch.Tensor) -> torch.Tensor:
    """Slot-balance loss: KL(batch-average sub-key distribution || uniform),
    averaged over heads and the two halves. 0 when every sub-key gets the same
    average probability, log(n_keys) when one sub-key takes everything.

    A uniform average over sub-keys of both halves makes the average slot
    distribution uniform too (it is their outer product for independent halves),
    at sqrt(N) cost. sub_scores: (T, H, 2, n_keys) -> scalar float32."""
    n_keys = sub_scores.shape[-1]
    mean_p = sub_scores.float().softmax(dim=-1).mean(dim=0)  # (H, 2, n_keys)
    kl = (mean_p * (mean_p.clamp_min(1e-30).log() + math.log(n_keys))).sum(dim=-1)  # (H, 2)
    return kl.mean()


def check_knn(knn: int, n_keys: int, key: str = "memory.knn") -> int:
    if not 1 <= knn <= n_keys:
        raise ConfigError(key, knn, f"an integer in [1, memory.n_keys={n_keys}]")
    return int(knn)


class ProductKeys(nn.Module):
    """Multi-head query projection + sub-keys; maps tokens to (weights, slots).

    `knn` is used in training mode, `eval_knn` in eval mode (self.training
    decides); both may be changed between steps (see memory/schedule.py)."""

    def __init__(
        self,
        dim: int,
        n_keys: int,
        heads: int,
        knn: int,
        k_dim: int,
        qk_norm: bool = False,
        eval_knn: int | None = None,
    ):
        super().__init__()
        if n_keys < 1:
            raise ConfigError("memory.n_keys", n_keys, "an integer >= 1")
        if heads < 1:
            raise ConfigError("memory.heads", heads, "an integer >= 1")
        if k_dim < 2 or k_dim % 2:
            raise ConfigError("memory.k_dim", k_dim, "a positive even integer (two halves of k_dim/2)")
        self.dim, self.n_keys, self.heads, self.k_dim = dim, n_keys, heads, k_dim
        self.half = k_dim // 2
        self.qk_norm = qk_norm
        self.knn = check_knn(knn, n_keys)
        self.eval_knn = check_knn(knn if eval_knn is None else eval_knn, n_keys, "memory.eval_knn")
        self.query = nn.Linear(dim, heads * k_dim, bias=True)  # W_q
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, self.half))
        self.init_weights()

    @property
    def current_knn(self) -> int:
        return self.knn if self.training else self.eval_knn

    def sub_scores(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, dim) -> sub-key scores (T, H, 2, n_keys), at least float32 so
        that top-k and softmax do not suffer bf16 ties."""
        compute = torch.promote_types(x.dtype, torch.float32)
        q = self.query(x).view(-1, self.heads, 2, self.half).to(compute)  # (T, H, 2, half)
        keys = self.keys.to(compute)
        if self.qk_norm:
            # QK-norm as in attention: unit-RMS query halves and sub-key rows,
            # dot product over sqrt(half), so the scores are sqrt(half) * cosine
            # whatever the scale the query projection drifts to.
            q = F.rms_norm(q, (self.half,))
            keys = F.rms_norm(keys, (self.half,))
            return subkey_scores(q, keys) / math.sqrt(self.half)
        return subkey_scores(q, keys)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> weights (T, H*knn) softmax per head in float32 (or
        wider), slots (T, H*knn) int64, sub-key scores (T, H, 2, n_keys)."""
        sub = self.sub_scores(x)
        scores, slots = product_key_topk(sub, self.current_knn)  # (T, H, knn) each
        weights = scores.softmax(dim=-1)
        return weights.flatten(1), slots.flatten(1), sub

    @torch.no_grad()
    def init_weights(self) -> None:
        # Published init: sub-keys uniform in +-1/sqrt(k_dim), W_q xavier-uniform.
        bound = self.k_dim**-0.5
        nn.init.uniform_(self.keys, -bound, bound)
        nn.init.xavier_uniform_(self.query.weight)
        nn.init.zeros_(self.query.bias)

    def flops_per_token(self) -> int:
        """Query projection, sub-key scoring (every head, both halves) and the
        knn*knn candidate sums per head."""
        query = 2 * self.dim * self.heads * self.k_dim
        scoring = 2 * self.heads * self.n_keys * self.k_dim  # 2 halves x n_keys x half x 2
        candidates = self.heads * self.knn * self.knn
        return query + scoring + candidates

    def extra_repr(self) -> str:
        return (
            f"n_keys={self.n_keys}, heads={self.heads}, knn={self.knn}, eval_knn={self.eval_knn}, "
            f"k_dim={self.k_dim}, qk_norm={self.qk_norm}"
        )
