"""UltraMemV2's layer in plain PyTorch, written the long way: the oracle of memory/ultramem.py.

    out = reference_forward(layer, x)   # an UltraMemV2 layer, x (..., dim) -> (..., dim)

or step by step (T tokens, H heads, rank r, n keys per side, m candidates, K = knn):

    q, keys = normalized_query_and_keys(x, layer.lookup)     # (T, H, 2, r, k_dim), (H, 2, r, n, k_dim)
    S_row, S_col = key_scores(q, keys)                       # (T, H, r, n) each
    S = grid_scores(S_row, layer.lookup.core, S_col)         # (T, H, n, n): every pair, bilinear in the core
    keep = candidate_mask(S_row, S_col, core, m)             # (T, H, n, n): top-m rows x top-m columns by C's
                                                             #   dominant singular pair
    scores, addresses = S.masked_fill(~keep, -inf).flatten(2).topk(K)   # (T, H, K), address i*n + j
    rows = layer.table_rows(addresses)                       # implicit value expansion: address -> table row
    h[t, h, k] = P[rows] . (W_pre x)                         # torch.dot, one read at a time
    y = sum over reads, in order, of (scores * h) * V[rows]  # one fused multiply-add per read
    out = W_v y

Every one of the n**2 pairs is scored and the candidate restriction is a mask
on the full grid: no candidate gather, no custom op, no kernel, no chunking;
O(n**2) per token and head, for small layers. The numbers that decide the
selection are computed as the layer computes them, so float32 outputs are
equal, not close (tests/unit/test_ultramem.py): the bilinear sums over rho,
then sigma, each term a separate multiply and add; the key scores by the
einsum memlm's product-key scoring uses; C's singular pair by torch.linalg.svd
with the layer's sign rule (u's largest entry positive); the read as
sequential fused multiply-adds (what F.embedding_bag's CPU kernel computes);
each pre-value dot by torch.dot (what memlm's row_dots computes). The
approximate step is part of the definition: the reference keeps the same
top-m rows and columns, not the exact top-K of the grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def normalized_query_and_keys(x: torch.Tensor, lookup: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, dim) -> q (T, H, 2, r, k_dim) = rms(W_q x) * g_q and keys (H, 2, r, n, k_dim) = rms(K) * g_k."""
    h, r, k = lookup.heads, lookup.rank, lookup.k_dim
    q = (x @ lookup.query.weight.t()).view(x.shape[0], h, 2, r, k)
    q = F.rms_norm(q, (k,)) * lookup.query_scale
    keys = F.rms_norm(lookup.keys, (k,)) * lookup.key_scale.unsqueeze(3)
    return q, keys


def key_scores(q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, 2, r, k_dim), keys (H, 2, r, n, k_dim) -> S_row, S_col (T, H, r, n):
    S[side, rho, i] = keys[side, rho, i] . q[side, rho]."""
    t, h, _, r, k = q.shape
    s = torch.einsum("thcd,hcnd->thcn", q.reshape(t, h, 2 * r, k), keys.reshape(h, 2 * r, -1, k))
    s = s.view(t, h, 2, r, -1)
    return s[:, :, 0], s[:, :, 1]


def grid_scores(row: torch.Tensor, core: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """row, col (T, H, r, n), core (H, r, r) -> (T, H, n, n):
    S[i, j] = sum_sig (sum_rho row[rho, i] C[rho, sig]) col[sig, j], summed in that order."""
    r = core.shape[-1]
    total = None
    for sig in range(r):
        a = None  # (T, H, n): sum_rho row[rho] C[rho, sig]
        for rho in range(r):
            term = row[:, :, rho] * core[None, :, rho, sig, None]
            a = term if a is None else a + term
        term = a.unsqueeze(-1) * col[:, :, sig].unsqueeze(-2)
        total = term if total is None else total + term
    return total


def dominant_pair(core: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """core (H, r, r) -> (u, t) (H, r): the singular vectors of the largest singular
    value, signed so that u's entry of largest magnitude (the first, on ties) is positive."""
    U, _, Vh = torch.linalg.svd(core.detach())
    u, t = U[:, :, 0], Vh[:, 0, :]
    sign = torch.where(u.gather(1, u.abs().argmax(dim=1, keepdim=True)) < 0, -1.0, 1.0).to(u.dtype)
    return u * sign, t * sign


def candidate_mask(row: torch.Tensor, col: torch.Tensor, core: torch.Tensor, m: int) -> torch.Tensor:
    """(T, H, n, n) True on the pairs of the m best rows by u . S_row and the m best columns by t . S_col."""
    u, t = dominant_pair(core)

    def rank1(scores, direction):  # (T, H, r, n), (H, r) -> (T, H, n): sum_rho direction[rho] scores[rho]
        out = None
        for rho in range(scores.shape[2]):
            term = scores[:, :, rho] * direction[None, :, rho, None]
            out = term if out is None else out + term
        return out

    def top_m(scores):  # (T, H, n) -> (T, H, n) bool
        chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        return chosen.scatter(-1, scores.topk(m, dim=-1).indices, True)

    keep_rows, keep_cols = top_m(rank1(row.detach(), u)), top_m(rank1(col.detach(), t))
    return keep_rows.unsqueeze(-1) & keep_cols.unsqueeze(-2)


def search(x: torch.Tensor, lookup: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, dim) -> scores (T, H, knn) best first and grid addresses (T, H, knn) = i * n + j."""
    row, col = key_scores(*normalized_query_and_keys(x, lookup))
    grid = grid_scores(row, lookup.core, col)  # (T, H, n, n)
    keep = candidate_mask(row, col, lookup.core, lookup.candidates)
    return grid.masked_fill(~keep, float("-inf")).flatten(2).topk(lookup.knn, dim=-1)


def pre_value_dots(table: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """table (N, pre_dim), rows (T, R), x (T, pre_dim) -> (T, R): table[rows[t, k]] . x[t]."""
    return torch.stack([torch.stack([torch.dot(table[s], x[t]) for s in rows[t]]) for t in range(rows.shape[0])])


def read(table: torch.Tensor, rows: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """table (N, v_dim), rows and coef (T, R) -> (T, v_dim): sum_k coef[:, k] * table[rows[:, k]],
    one fused multiply-add per read, in read order."""
    y = torch.zeros(rows.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    for k in range(rows.shape[1]):
        y = torch.addcmul(y, coef[:, k, None].to(table.dtype), table[rows[:, k]])
    return y


def reference_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's output by the plain math above, from its own parameters. x (..., dim) -> (..., dim)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (T, dim)
    scores, addresses = search(x, layer.lookup)  # (T, H, knn) each
    rows = layer.table_rows(addresses).flatten(1)  # (T, H*knn)
    h = pre_value_dots(layer.pre_values.weight, rows, x @ layer.pre_proj.weight.t())  # (T, H*knn)
    y = read(layer.values.weight, rows, scores.flatten(1) * h).to(x.dtype)  # (T, v_dim)
    return (y @ layer.value_proj.weight.t()).reshape(shape)
