"""memlm's UltraMemV2 feed-forward in transformers (trust_remote_code): torch only.

Copied verbatim into every non-dense export beside modeling_memlm.py, which builds one per
block of kind `ultramem`:

    ffn = UltraMemFFN(config.hidden_size, config.intermediate_size, config.memory)
    out = ffn(x)   # x (batch, seq, dim) -> (batch, seq, dim): the memory layer plus a smaller SwiGLU

The search is UltraMem's Tucker-decomposed query-key retrieval (memlm memory/ultramem_search.py),
the layer memlm's memory/ultramem.py, both restated in plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers_memlm import VALUE_DTYPES, SwiGLU, ValuePool, full_precision, row_dots


def _rank_sum(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """scores (T, H, r, A), weights (H, r) -> (T, H, A): sum_rho weights[rho] * scores[rho], in rho order."""
    out = scores[:, :, 0] * weights[None, :, 0, None]
    for rho in range(1, scores.shape[2]):
        out = out + scores[:, :, rho] * weights[None, :, rho, None]
    return out


def _bilinear(rows: torch.Tensor, core: torch.Tensor, cols: torch.Tensor, grid: bool) -> torch.Tensor:
    """sum_sig (sum_rho rows[rho] C[rho, sig]) cols[sig]: rows (T, H, r, A), cols (T, H, r, B) ->
    (T, H, A, B) for the grid of every pair, or (T, H, A) for the pairs (rows[a], cols[a]) (A == B)."""
    out = None
    for sig in range(cols.shape[2]):
        left = _rank_sum(rows, core[:, :, sig])
        term = left.unsqueeze(-1) * cols[:, :, sig].unsqueeze(-2) if grid else left * cols[:, :, sig]
        out = term if out is None else out + term
    return out


def tucker_topk(row_scores, col_scores, core, candidates: int, knn: int):
    """UltraMem's TDQKR (memlm memory/ultramem_search.py): the top-`candidates` rows and columns by
    the core's dominant singular pair, then the exact bilinear scores of those pairs and their top-knn.
    row_scores, col_scores (T, H, r, n), core (H, r, r) -> scores, rows, cols (T, H, knn)."""
    U, _, Vh = torch.linalg.svd(core)
    u, t = U[..., :, 0], Vh[..., 0, :]  # (H, r) each
    lead = u.abs().argmax(dim=-1, keepdim=True)
    sign = torch.where(u.gather(-1, lead) < 0, -1.0, 1.0).to(u.dtype)  # u's largest entry positive
    u, t = u * sign, t * sign
    cand_rows = _rank_sum(row_scores, u).topk(candidates, dim=-1)[1]  # (T, H, m)
    cand_cols = _rank_sum(col_scores, t).topk(candidates, dim=-1)[1]

    def keys(scores, idx):  # (T, H, r, n), (T, H, K) -> (T, H, r, K)
        return scores.gather(-1, idx.unsqueeze(2).expand(-1, -1, scores.shape[2], -1))

    grid = _bilinear(keys(row_scores, cand_rows), core, keys(col_scores, cand_cols), grid=True)  # (T, H, m, m)
    best = grid.flatten(-2).topk(knn, dim=-1)[1]  # (T, H, knn)
    rows = cand_rows.gather(-1, torch.div(best, candidates, rounding_mode="floor"))
    cols = cand_cols.gather(-1, best % candidates)
    scores = _bilinear(keys(row_scores, rows), core, keys(col_scores, cols), grid=False)  # (T, H, knn)
    return scores, rows, cols


class TuckerKeys(nn.Module):
    def __init__(self, dim: int, m: dict):
        super().__init__()
        self.heads, self.rank, self.k_dim, self.n_keys = m["heads"], m["rank"], m["k_dim"], m["n_keys"]
        self.knn, self.candidates = m["knn"], m["candidates"]
        self.query = nn.Linear(dim, self.heads * 2 * self.rank * self.k_dim, bias=False)
        self.keys = nn.Parameter(torch.zeros(self.heads, 2, self.rank, self.n_keys, self.k_dim))
        self.query_scale = nn.Parameter(torch.ones(self.heads, 2, self.rank, self.k_dim))
        self.key_scale = nn.Parameter(torch.ones(self.heads, 2, self.rank, self.k_dim))
        self.core = nn.Parameter(torch.zeros(self.heads, self.rank, self.rank))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> scores (T, H, knn) float32+, grid addresses i * n + j (T, H, knn)."""
        weight = self.query.weight
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        with full_precision(x.device):
            q = F.linear(x.to(compute), weight.to(compute)).view(-1, self.heads, 2, self.rank, self.k_dim)
            q = F.rms_norm(q, (self.k_dim,)) * self.query_scale.to(compute)
            keys = F.rms_norm(self.keys.to(compute), (self.k_dim,)) * self.key_scale.to(compute)[:, :, :, None]
            s = torch.einsum("thcd,hcnd->thcn", q.flatten(2, 3), keys.flatten(1, 2))
            s = s.view(-1, self.heads, 2, self.rank, self.n_keys)
            scores, rows, cols = tucker_topk(s[:, :, 0], s[:, :, 1], self.core.to(compute), self.candidates, self.knn)
        return scores, rows * self.n_keys + cols


class PreValueTable(nn.Module):
    def __init__(self, n_rows: int, pre_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_rows, pre_dim))


class UltraMem(nn.Module):
    """UltraMemV2's layer (memlm memory/ultramem.py): W_v sum_s score_s (P[s] . W_pre x) V[s]."""

    def __init__(self, dim: int, m: dict):
        super().__init__()
        self.dim, self.expansion = dim, m["expansion"]
        n_rows = m["n_keys"] ** 2 // self.expansion
        self.lookup = TuckerKeys(dim, m)
        self.pre_proj = nn.Linear(dim, m["pre_dim"], bias=False)
        self.pre_values = PreValueTable(n_rows, m["pre_dim"])
        self.value_proj = nn.Linear(m["v_dim"], dim, bias=False)
        self.values = ValuePool(n_rows, m["v_dim"], VALUE_DTYPES[m["value_dtype"]])
        if self.expansion > 1:  # the export holds the grid-address -> row map memlm trained with
            self.register_buffer("address_rows", torch.zeros(m["n_keys"] ** 2, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        scores, addresses = self.lookup(x)  # (T, H, knn) each
        rows = (addresses if self.expansion == 1 else self.address_rows[addresses]).flatten(1)  # (T, H*knn)
        h = row_dots(self.pre_values.weight, rows, self.pre_proj(x))  # (T, H*knn)
        y = self.values.read(rows, scores.flatten(1).to(h.dtype) * h).to(x.dtype)  # (T, v_dim)
        return self.value_proj(y).reshape(shape)


class UltraMemFFN(nn.Module):
    """The layer beside a SwiGLU of the dense width times memory.ffn_fraction (memlm model/ultramem_ffn.py)."""

    def __init__(self, dim: int, intermediate_size: int, m: dict):
        super().__init__()
        self.memory = UltraMem(dim, m)
        hidden = int(round(intermediate_size * m["ffn_fraction"]))
        self.ffn = SwiGLU(dim, hidden) if hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.memory(x)
        return out if self.ffn is None else out + self.ffn(x)
