"""Tucker-decomposed query-key retrieval (TDQKR): which grid addresses a token reads, and their scores.

UltraMem (arXiv 2411.12364) and UltraMemV2 (arXiv 2508.18756) score the n x n
grid of (row key i, column key j) pairs through a small rank-r core C
(docs/memory.md, "UltraMemV2 (standalone layer)"):

    S_row[rho, i] = k_row[rho, i] . q_row[rho]       (r row scores per row key)
    S_col[sig, j] = k_col[sig, j] . q_col[sig]
    S[i, j]       = sum_{rho, sig} S_row[rho, i] C[rho, sig] S_col[sig, j]

The top-k of all n**2 bilinear scores has no sqrt(N) shortcut, so the search
is approximate, then exact:
1. C's dominant singular pair (u, t): the rank-1 scores u . S_row and t . S_col;
2. the top-`candidates` rows and columns by those (memlm's half top-k,
   memory/fast/search.py);
3. the exact bilinear score of each of the candidates**2 pairs; top-knn of them.

    scores, rows, cols = tucker_topk(row_scores, col_scores, core, candidates, knn)
    # row_scores, col_scores (T, H, r, n); core (H, r, r) -> (T, H, knn) each, sorted descending;
    # scores differentiable in row_scores, col_scores and core; rows, cols int64 key indices

The selection (steps 1-3) builds no autograd graph over the candidates**2
grid: the knn winners' scores are recomputed differentiably by the same
sums in the same order, so they are bit for bit the selected numbers. Every
bilinear score here sums over rho, then sig, each term a separate multiply
and add (`bilinear_grid`, `bilinear_pairs`): the plain reference
(memory/ultramem_reference.py) computes its full grid the same way, so float32
results are equal, not close.
"""

from __future__ import annotations

import torch

from memlm.memory.fast.native_topk import topk as rows_topk
from memlm.memory.fast.search import half_topk

# The no-grad candidate grid is scored this many elements at a time (16 MB of float32).
GRID_CHUNK = 1 << 22
# Monte Carlo of the initialization's score statistics (calibrate_scores): tokens
# per head, and the seed of the generator that draws their scores.
CALIBRATION_SAMPLES = 512
CALIBRATION_SEED = 0x0DD5C0DE


@torch.no_grad()
def dominant_directions(core: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """core (H, r, r) -> u (H, r), t (H, r): the left and right singular vectors of
    each core's largest singular value (C ~ lambda_1 u t^T), no gradient.

    A singular pair is defined up to a joint sign, and the sign decides which
    rows the approximate search keeps (the top of u . S_row, not the bottom).
    We fix it: u's entry of largest magnitude (the first, on ties) is positive.
    A rank-1 core C = [[c]] gets u = 1, t = sign(c)."""
    U, _, Vh = torch.linalg.svd(core)  # core: float32 or float64
    u, t = U[..., :, 0], Vh[..., 0, :]  # (H, r) each
    lead = u.abs().argmax(dim=-1, keepdim=True)  # (H, 1)
    sign = torch.where(u.gather(-1, lead) < 0, -1.0, 1.0).to(u.dtype)  # (H, 1)
    return u * sign, t * sign


def combine_ranks(scores: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """scores (T, H, r, n), direction (H, r) -> (T, H, n): sum_rho direction[rho] * scores[rho],
    summed in rho order (the rank-1 score of step 1)."""
    out = scores[:, :, 0] * direction[None, :, 0, None]
    for rho in range(1, scores.shape[2]):
        out = out + scores[:, :, rho] * direction[None, :, rho, None]
    return out


def _row_times_core(rows: torch.Tensor, core: torch.Tensor, sig: int) -> torch.Tensor:
    """rows (T, H, r, A), core (H, r, r) -> (T, H, A): sum_rho rows[rho] * C[rho, sig], in rho order."""
    out = rows[:, :, 0] * core[None, :, 0, sig, None]
    for rho in range(1, rows.shape[2]):
        out = out + rows[:, :, rho] * core[None, :, rho, sig, None]
    return out


def bilinear_grid(rows: torch.Tensor, core: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """rows (T, H, r, A), core (H, r, r), cols (T, H, r, B) -> (T, H, A, B):
    S[a, b] = sum_sig (sum_rho rows[rho, a] C[rho, sig]) cols[sig, b]."""
    out = _row_times_core(rows, core, 0).unsqueeze(-1) * cols[:, :, 0].unsqueeze(-2)
    for sig in range(1, cols.shape[2]):
        out = out + _row_times_core(rows, core, sig).unsqueeze(-1) * cols[:, :, sig].unsqueeze(-2)
    return out


def bilinear_pairs(rows: torch.Tensor, core: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """rows, cols (T, H, r, K), core (H, r, r) -> (T, H, K): the bilinear score of each
    (rows[..., k], cols[..., k]) pair, by bilinear_grid's sums in its order."""
    out = _row_times_core(rows, core, 0) * cols[:, :, 0]
    for sig in range(1, cols.shape[2]):
        out = out + _row_times_core(rows, core, sig) * cols[:, :, sig]
    return out


def _gather_keys(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """scores (T, H, r, n), idx (T, H, K) key indices -> (T, H, r, K): every rank's score of those keys."""
    return scores.gather(-1, idx.unsqueeze(2).expand(-1, -1, scores.shape[2], -1))


@torch.no_grad()
def candidate_keys(row_scores: torch.Tensor, col_scores: torch.Tensor, core: torch.Tensor,
                   candidates: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Steps 1-2: the approximate search. row_scores, col_scores (T, H, r, n), core (H, r, r) ->
    ((rank-1 scores, key indices) of the kept rows, the same of the kept columns), each
    (T, H, candidates), best first (memlm's half top-k, memory/fast/search.py)."""
    u, t = dominant_directions(core)
    return (half_topk(combine_ranks(row_scores, u), candidates),
            half_topk(combine_ranks(col_scores, t), candidates))


@torch.no_grad()
def _select(row_scores, col_scores, core, candidates, knn):
    """Steps 1-3 without a graph: the winners' row and column key indices (T, H, knn), best first."""
    (_, cand_rows), (_, cand_cols) = candidate_keys(row_scores, col_scores, core, candidates)  # (T, H, m) each
    rows, cols = _gather_keys(row_scores, cand_rows), _gather_keys(col_scores, cand_cols)  # (T, H, r, m)
    tokens, heads = row_scores.shape[:2]
    chunk = max(1, GRID_CHUNK // max(1, heads * candidates * candidates))
    best = torch.empty(tokens, heads, knn, dtype=torch.long, device=row_scores.device)
    for lo in range(0, tokens, chunk):
        grid = bilinear_grid(rows[lo:lo + chunk], core, cols[lo:lo + chunk])  # (c, H, m, m)
        best[lo:lo + chunk] = rows_topk(grid.flatten(-2), knn)[1]
    pick_rows = cand_rows.gather(-1, torch.div(best, candidates, rounding_mode="floor"))
    pick_cols = cand_cols.gather(-1, best % candidates)
    return pick_rows, pick_cols


def tucker_topk(
    row_scores: torch.Tensor, col_scores: torch.Tensor, core: torch.Tensor, candidates: int, knn: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The TDQKR search (module docstring). row_scores, col_scores (T, H, r, n),
    core (H, r, r), 1 <= candidates <= n, 1 <= knn <= candidates**2 ->
    scores (T, H, knn) sorted descending (differentiable), rows and cols (T, H, knn) int64."""
    n = row_scores.shape[-1]
    if not 1 <= candidates <= n or not 1 <= knn <= candidates * candidates:
        raise ValueError(f"tucker_topk needs 1 <= candidates <= n={n} and 1 <= knn <= candidates**2, "
                         f"got candidates={candidates}, knn={knn}")
    rows, cols = _select(row_scores, col_scores, core, candidates, knn)
    scores = bilinear_pairs(_gather_keys(row_scores, rows), core, _gather_keys(col_scores, cols))
    return scores, rows, cols


@torch.no_grad()
def calibrate_scores(core: torch.Tensor, n_keys: int, candidates: int, knn: int,
                     samples: int = CALIBRATION_SAMPLES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean and the standard deviation of the knn scores a token reads per head
    (tucker_topk) when its row and column scores are independent N(0, 1): what
    unit-RMS queries and keys give at initialization, with the key scale 1/sqrt(k_dim).
    UltraMemV2's init (its Appendix A.2) measures these by simulation; so do we,
    from a fixed seed on the CPU: a function of the core and the sizes only.
    core (H, r, r) -> mean (H,), std (H,), and the mean's Monte Carlo standard
    error (H,) (the spread of the per-token means over sqrt(samples)), float64."""
    heads, rank = core.shape[:2]
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    draw = torch.randn(2, samples, heads, rank, n_keys, generator=gen)  # rows, cols
    scores = tucker_topk(draw[0], draw[1], core.detach().float().cpu(), candidates, knn)[0].double()  # (S, H, knn)
    per_head = scores.transpose(0, 1).reshape(heads, -1)
    stderr = scores.mean(dim=2).std(dim=0) / samples**0.5
    return per_head.mean(dim=1), per_head.std(dim=1), stderr
