"""Exact product-key search: which knn of the n_keys**2 slots score highest.

N = n_keys**2 slots; slot (i, j) has key [k1_i ; k2_j], so its score against a
query [q1 ; q2] is s1[i] + s2[j]. The top-k of all N sums is found exactly at
sqrt(N) cost: a pair in the overall top-k has each half in its own half's
top-k, so scoring the candidates built from the two half top-k's suffices
(Lample et al. 2019; docs/memory.md, "The math, as implemented").

This module is the forward search, differentiable through autograd (dense).
The layers call `memlm.memory.fast.search_grad.product_key_search`: the same search
with a backward through the selected sub-keys only.
"""

from __future__ import annotations

import functools

import torch

from memlm.memory.fast.native_topk import topk as rows_topk

# Half top-k through block maxima (see half_topk) from n_keys >= this * knn.
BLOCK_TOPK_RATIO = 16
BLOCK = 4


def subkey_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query (T, H, 2, half), keys (H, 2, n_keys, half), or (2, n_keys, half)
    shared by the heads -> scores (T, H, 2, n_keys)."""
    if keys.dim() == 3:
        return torch.einsum("thcd,cnd->thcn", query, keys)
    return torch.einsum("thcd,hcnd->thcn", query, keys)


def half_topk(sub_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`knn` of each row's last dim, sorted descending: values and indices.

    On CPU the top-k runs through memlm.memory.fast.native_topk (a C kernel,
    faster than torch.topk on short rows: bench/topk.py, docs/benchmarks.md). Its cost still grows with
    the elements scanned, whatever k. For long rows on CPU we first take the max of each block of BLOCK
    scores (a vectorized pass), keep the knn blocks with the largest maxima, and take the top-knn
    of their knn*BLOCK scores: n/BLOCK + knn*BLOCK elements scanned instead of
    n (384 instead of 1024 at n 1024, knn 32; 1.6x faster). Exact: an element
    of the top knn has fewer than knn larger elements, so fewer than knn
    blocks have a larger maximum than its block, which is therefore kept
    (among equal values any may be kept, as with torch.topk). Block j holds
    the elements j, j + n/BLOCK, j + 2n/BLOCK, ...: any partition works, and
    this one makes the block maxima an elementwise max of BLOCK contiguous
    slices (3x faster than reducing blocks of adjacent elements)."""
    n = sub_scores.shape[-1]
    if n < BLOCK_TOPK_RATIO * knn or n % BLOCK or sub_scores.device.type != "cpu":
        return rows_topk(sub_scores, knn)  # (torch.topk on accelerators, where it is cheap: no detour)
    width = n // BLOCK
    # Along the last dim only: the einsum's (T, H, 2, n) output is a permuted
    # view, and flattening it to rows would copy the whole score tensor.
    block_max = sub_scores.unflatten(-1, (BLOCK, width)).amax(dim=-2)  # (..., n / BLOCK)
    blocks = rows_topk(block_max, knn)[1]  # (..., knn)
    offsets = torch.arange(0, n, width, device=blocks.device, dtype=blocks.dtype)
    cand_idx = (blocks.unsqueeze(-1) + offsets).flatten(-2)  # (..., knn * BLOCK)
    values, best = rows_topk(sub_scores.gather(-1, cand_idx), knn)
    return values, cand_idx.gather(-1, best)


@functools.lru_cache(maxsize=64)
def _candidate_pairs(knn: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ranks (a, b) in the two sorted top-k lists with (a + 1) * (b + 1) <= knn.

    With both lists sorted descending, s1[a] + s2[b] is at most each of the
    (a + 1) * (b + 1) sums s1[a'] + s2[b'] with a' <= a, b' <= b; if that count
    exceeds knn, knn other candidates are at least as good and (a, b) cannot
    be needed. That leaves about knn * ln(knn) candidates instead of knn**2
    (119 instead of 1024 for knn = 32). Built on the host once per (knn,
    device): a read-only memo, no host sync on the hot path. Returns the
    ranks a, b, and both as rows (a, b) of one (n_candidates, 2) tensor."""
    pairs = [(a, b) for a in range(knn) for b in range(knn) if (a + 1) * (b + 1) <= knn]
    ranks = torch.tensor(pairs, dtype=torch.long, device=device)  # (n_candidates, 2)
    return ranks[:, 0].contiguous(), ranks[:, 1].contiguous(), ranks


def product_key_topk(
    sub_scores: torch.Tensor, knn: int, ordered: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-`knn` of s1[i] + s2[j] over all n_keys**2 slots, per token and head
    (ties aside: among equal sums any may be kept). Differentiable through
    autograd (dense); `product_key_search` is the same search with the sparse
    backward.

    sub_scores: (T, H, 2, n_keys) -> scores (T, H, knn), slots (T, H, knn)
    int64 with slot = i * n_keys + j. Descending if `ordered`; else the same
    knn (score, slot) pairs in an unspecified order (the memory layers' case:
    a softmax and a weighted sum do not need the order; torch.topk then skips
    the sort of each row's winners, ~1.4x faster on CPU; memlm's CPU kernel
    returns them sorted at no extra cost)."""
    scores, half_idx, ranks = topk_with_ranks(sub_scores, knn, ordered)
    return scores, slots_of(half_idx, ranks, sub_scores.shape[-1])


def topk_with_ranks(
    sub_scores: torch.Tensor, knn: int, ordered: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """product_key_topk, with the winners given by their ranks in the half
    lists: scores (T, H, knn), half_idx (T, H, 2, knn) the sorted top-knn
    sub-keys of each half, ranks (T, H, 2, knn): winner k is the pair
    (half_idx[..., 0, ranks[..., 0, k]], half_idx[..., 1, ranks[..., 1, k]])."""
    # One top-k over both halves (not one per slice). Sorted, so only the
    # pairs of _candidate_pairs can reach the final top-k.
    half_scores, half_idx = half_topk(sub_scores, knn)  # (T, H, 2, knn)
    s1, s2 = half_scores.unbind(2)  # (T, H, knn) each
    a, b, pairs = _candidate_pairs(knn, sub_scores.device)
    lead = s1.shape[:-1]

    def pick(x: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        # On a 2-D contiguous tensor, index_select along dim 1 is ~15x faster
        # on CPU than along the last dim of the strided (T, H, knn) view.
        return x.reshape(-1, knn).index_select(1, ranks).view(*lead, -1)

    # (T, H, knn) of ~knn ln knn; the half lists must be sorted, the winners need
    # not be (torch.topk skips their sort; the CPU kernel sorts at no extra cost).
    candidates = pick(s1, a) + pick(s2, b)
    if candidates.device.type == "cpu":
        scores, best = rows_topk(candidates, knn)
    else:
        scores, best = candidates.topk(knn, dim=-1, sorted=ordered)
    # The winners' (a, b) in one 1-D index_select (3x faster than a[best], b[best] + stack).
    ranks = pairs.index_select(0, best.reshape(-1)).view(*lead, knn, 2).transpose(-1, -2)
    return scores, half_idx, ranks


def slots_of(half_idx: torch.Tensor, ranks: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(T, H, 2, knn) sub-keys and winner ranks -> (T, H, knn) slots i * n_keys + j."""
    i, j = half_idx.gather(-1, ranks).unbind(2)
    return i * n_keys + j
