"""UltraMemV2's memory layer (arXiv 2508.18756, on UltraMem, arXiv 2411.12364), standalone.

Maps (..., dim) -> (..., dim) inside any PyTorch model:

    from memlm.memory.ultramem import UltraMemV2
    mem = UltraMemV2(dim=512, n_keys=256, heads=1, rank=2, knn=32)
    y = mem(x)  # x: (batch, seq, 512), the block's normalized hidden state

Per token (docs/memory.md, "UltraMemV2 (standalone layer)"; shapes for T tokens,
H heads, rank r, n keys per side, N = n**2 / expansion table rows):

    q = W_q x                                    (T, H, 2, r, k_dim)  a row and a column query per rank
    q, K = rms(q) * g_q, rms(K) * g_k            query and key norms with learned scales
    S_row, S_col = K q                           (T, H, r, n) each
    scores, (i, j) = TDQKR top-knn of S_row^T C S_col     (T, H, knn)  memory/ultramem_search.py
    s = address_rows[i * n + j]                  (T, H*knn)  implicit value expansion: E grid addresses per row
    h = P[s] . (W_pre x)                         (T, H*knn)  PEER-style pre-values, no activation
    y = sum over the H*knn reads of scores * h * V[s]       (T, v_dim)  ValuePool.read
    out = W_v y                                  (T, dim)    the single value projection

The scores are the weights as they are (no softmax). V and P are the sparse
tables (`param_category = "memory"`); V is a `ValuePool` read through
memlm's read op and kernels (memory/fast/ops.py) and its gradient buffer.
memory/ultramem_reference.py states the same math plainly (the tests' oracle).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memlm.memory.config import KERNELS, check_choice
from memlm.memory.fast.exact import exact_linear, exact_subkey_scores, full_precision
from memlm.memory.fast.ops import resolve_kernel
from memlm.memory.fast.row_dots import row_dots
from memlm.memory.ultramem_search import calibrate_scores, tucker_topk
from memlm.memory.usage import SlotUsage
from memlm.memory.values import ValuePool

# Seed of the fixed random map from grid addresses to table rows (expansion > 1).
ADDRESS_SEED = 0x1BE5EED
# UltraMemV2's reference FFN at init (its Appendix A.3): inner activation variance 0.16,
# linears N(0, 2 / (5 dim)), the last one scaled by 1 / sqrt(2 L).
FFN_INNER_VAR, LINEAR_VAR = 0.16, 0.4


def _check(key: str, value, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: {valid}")


def default_v_dim(dim: int) -> int:
    """V's width when not given: 3 dim / 16 (UltraMemV2's pre_dim : v_dim = 1 : 3, their sum dim / 4)."""
    return max(1, 3 * dim // 16)


def ffn_output_var(n_layers: int, ffn_mult: float) -> float:
    """The output variance at init of the SwiGLU FFN the paper matches (its eq. 25):
    0.16 * 0.4 * ffn_mult / (2 * n_layers), ffn_mult = FFN inner dim / model dim."""
    return FFN_INNER_VAR * LINEAR_VAR * ffn_mult / (2 * n_layers)


class TuckerKeys(nn.Module):
    """Queries, keys, their norms and the cores: x -> (knn scores, grid addresses) per head.

    Computes in IEEE float32 (or wider) whatever autocast says, like the
    product-key lookup (memory/product_keys.py), so the selection is the float32 model's."""

    full_precision_params = True  # (read by memlm.distributed.parallelize, as ProductKeys')

    def __init__(self, dim: int, n_keys: int, heads: int, rank: int, k_dim: int, knn: int, candidates: int):
        super().__init__()
        self.dim, self.n_keys, self.heads, self.rank, self.k_dim = dim, n_keys, heads, rank, k_dim
        self.knn, self.candidates = knn, candidates
        self.query = nn.Linear(dim, heads * 2 * rank * k_dim, bias=False)  # W_q: separate queries per rank
        self.keys = nn.Parameter(torch.empty(heads, 2, rank, n_keys, k_dim))  # row (0) and column (1) keys
        self.query_scale = nn.Parameter(torch.empty(heads, 2, rank, k_dim))  # g_q: the query norm's weight
        self.key_scale = nn.Parameter(torch.empty(heads, 2, rank, k_dim))  # g_k: the key norm's weight
        self.core = nn.Parameter(torch.empty(heads, rank, rank))  # C, one per head
        self.score_std = 0.0  # set by init_weights: the knn scores' std at init (their mean is ~1)

    def key_scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> S_row, S_col (T, H, r, n), float32 or wider, differentiable."""
        weight = self.query.weight
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        with full_precision(x.device):
            q = exact_linear(x.to(compute), weight.to(compute), weight.new_zeros(weight.shape[0], dtype=compute))
            q = q.view(-1, self.heads, 2, self.rank, self.k_dim)
            q = F.rms_norm(q, (self.k_dim,)) * self.query_scale.to(compute)
            keys = F.rms_norm(self.keys.to(compute), (self.k_dim,)) * self.key_scale.to(compute)[:, :, :, None]
            # (T, H, 2r, k_dim) x (H, 2r, n, k_dim) -> (T, H, 2r, n): TF32 off (memory/fast/exact.py)
            s = exact_subkey_scores(q.flatten(2, 3), keys.flatten(1, 2)).view(-1, self.heads, 2, self.rank,
                                                                             self.n_keys)
        return s[:, :, 0], s[:, :, 1]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> scores (T, H, knn) float32+, best first, and grid addresses
        (T, H, knn) int64: row key i and column key j are address i * n + j."""
        row_scores, col_scores = self.key_scores(x)
        with full_precision(x.device):
            core = self.core.to(row_scores.dtype)
            scores, rows, cols = tucker_topk(row_scores, col_scores, core, self.candidates, self.knn)
        return scores, rows * self.n_keys + cols

    @torch.no_grad()
    def init_weights(self, init_std: float) -> None:
        """W_q ~ N(0, init_std); keys ~ N(0, 1) (unit RMS: the norm then starts as the
        identity); g_k = 1/sqrt(k_dim); C = diag(1, 1/2, 1/4, ...); g_q per head so the
        mean knn score at init is 1 (calibrate_scores), which also gives score_std."""
        nn.init.normal_(self.query.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.keys)
        nn.init.constant_(self.key_scale, self.k_dim**-0.5)
        self.core.copy_(torch.diag_embed(0.5 ** torch.arange(self.rank, dtype=self.core.dtype))
                        .expand(self.heads, -1, -1))
        mean, std, stderr = calibrate_scores(self.core, self.n_keys, self.candidates, self.knn)  # (H,) each
        if not bool((mean > 4 * stderr).all()):  # the init divides by the mean: it must be clearly > 0
            raise ValueError(f"knn={self.knn} is invalid for the paper's init: the mean of the {self.knn} best "
                             f"of the {self.candidates}**2 candidate scores is not clearly positive at init "
                             f"({mean.min().item():.3g}, Monte Carlo error {stderr.max().item():.2g}), so no "
                             f"query scale brings it to 1; choose knn well below candidates**2")
        # Scores are bilinear in the row and column queries: scaling both by mean**-0.5 scales them by 1/mean.
        self.query_scale.copy_(mean.rsqrt().to(self.query_scale.dtype)[:, None, None, None].expand_as(
            self.query_scale))
        self.score_std = float(((std / mean) ** 2).mean().sqrt())

    def flops_per_token(self) -> int:
        """Query projection, key scoring (both sides, every rank), the rank-1 scores,
        and the exact scores of the candidates**2 pairs (r multiply-adds per side)."""
        h, r, n, m = self.heads, self.rank, self.n_keys, self.candidates
        return (2 * self.dim * h * 2 * r * self.k_dim + 2 * h * 2 * r * n * self.k_dim + 2 * h * 2 * r * n
                + 2 * h * r * (r * m + m * m))


class PreValueTable(nn.Module):
    """The pre-values P (N, pre_dim): each row's dot with W_pre x scales its value (PEER's down vectors)."""

    param_category = "memory"  # a sparse table: rows get gradient only when read (memlm.memory.tables)

    def __init__(self, n_rows: int, pre_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_rows, pre_dim))


class UltraMemV2(nn.Module):
    """The layer (module docstring). Defaults follow UltraMemV2's findings: one head,
    k_dim = dim / 2, pre_dim : v_dim = 1 : 3 with pre_dim + v_dim = dim / 4; rank 2;
    `candidates` (rows and columns kept by the approximate search) = min(knn, n_keys).

    `n_layers` (L) and `ffn_mult` (the FFN beside it: inner dim / dim) only set the
    paper's init: the layer's output variance at init equals that FFN's."""

    def __init__(self, dim: int, n_keys: int = 256, heads: int = 1, rank: int = 2, knn: int = 32,
                 k_dim: int | None = None, candidates: int | None = None, expansion: int = 1,
                 v_dim: int | None = None, pre_dim: int | None = None, n_layers: int = 1,
                 ffn_mult: float = 4.0, sparse_updates: bool = False, kernel: str = "auto",
                 value_dtype: torch.dtype = torch.float32, layer_id: int | None = None):
        super().__init__()
        k_dim = max(1, dim // 2) if k_dim is None else k_dim
        v_dim = default_v_dim(dim) if v_dim is None else v_dim
        pre_dim = max(1, dim // 16) if pre_dim is None else pre_dim
        candidates = min(knn, n_keys) if candidates is None else candidates
        for key, value in (("dim", dim), ("n_keys", n_keys), ("heads", heads), ("rank", rank), ("knn", knn),
                           ("k_dim", k_dim), ("v_dim", v_dim), ("pre_dim", pre_dim), ("n_layers", n_layers)):
            _check(key, value, isinstance(value, int) and value >= 1, "an integer >= 1")
        _check("candidates", candidates, 1 <= candidates <= n_keys,
               f"an integer in [1, n_keys={n_keys}] (rows and columns kept by the approximate search)")
        _check("knn", knn, 1 <= knn <= candidates * candidates,
               f"an integer in [1, candidates**2={candidates * candidates}] (candidates={candidates})")
        _check("expansion", expansion, isinstance(expansion, int) and expansion >= 1 and n_keys**2 % expansion == 0,
               f"an integer >= 1 dividing n_keys**2={n_keys**2} (grid addresses per table row)")
        _check("ffn_mult", ffn_mult, ffn_mult > 0, "a number > 0 (FFN inner dim / dim, for the init)")
        check_choice("kernel", kernel, KERNELS)
        resolve_kernel(kernel)  # fail at build time if this machine cannot run it at all
        self.dim, self.v_dim, self.pre_dim, self.expansion = dim, v_dim, pre_dim, expansion
        self.n_layers, self.ffn_mult = n_layers, ffn_mult
        self.sparse_updates, self.kernel, self.layer_id = sparse_updates, kernel, layer_id
        self.n_rows = n_keys**2 // expansion
        self.lookup = TuckerKeys(dim, n_keys, heads, rank, k_dim, knn, candidates)
        self.pre_proj = nn.Linear(dim, pre_dim, bias=False)  # W_pre
        self.pre_values = PreValueTable(self.n_rows, pre_dim)  # P
        self.value_proj = nn.Linear(v_dim, dim, bias=False)  # W_v: one projection for every address
        self._init_all_but_values()  # V's init std depends on the rest: the pool initializes itself with it
        self.values = ValuePool(self.n_rows, v_dim, self.value_std() * v_dim**0.5, value_dtype)  # V
        self.values.add_reader(heads * knn)
        if expansion > 1:
            # Implicit value expansion (UltraMem's Shuffle, then V2's single projection): a fixed
            # random map from the n**2 grid addresses onto the N rows, each row taking `expansion`
            # of them. Persistent, so a checkpoint carries the map it was trained with.
            self.register_buffer("address_rows", self._address_map(n_keys))
        self.usage = SlotUsage(self.n_rows)

    def _address_map(self, n_keys: int) -> torch.Tensor:
        """(n_keys**2,) int64: grid address -> table row, a fixed random permutation modulo the rows."""
        gen = torch.Generator().manual_seed(ADDRESS_SEED)
        return torch.randperm(n_keys**2, generator=gen) % self.n_rows

    @property
    def init_std(self) -> float:
        """Every linear's init std, sqrt(2 / (5 dim)) (the paper's, after Nguyen and Salazar)."""
        return math.sqrt(LINEAR_VAR / self.dim)

    def table_rows(self, addresses: torch.Tensor) -> torch.Tensor:
        """Grid addresses (any shape) -> the table rows they read."""
        return addresses if self.expansion == 1 else self.address_rows[addresses]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim) -> (..., dim)
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        scores, addresses = self.lookup(x)  # (T, H, knn) each
        rows = self.table_rows(addresses).flatten(1)  # (T, H*knn): one bag of H*knn reads per token
        if self.training:
            self.usage.record(rows)
        h = row_dots(self.pre_values.weight, rows, self.pre_proj(x))  # (T, H*knn): P[s] . W_pre x
        coef = scores.flatten(1).to(h.dtype) * h  # (T, H*knn)
        y = self.values.read(rows, coef, sparse=self.sparse_updates, kernel=self.kernel).to(x.dtype)  # (T, v_dim)
        return self.value_proj(y).reshape(shape)

    def row_tables(self) -> list[nn.Parameter]:
        """The tables whose rows are the slots `usage` counts: V and P, read at the same rows."""
        return [self.values.weight, self.pre_values.weight]

    def value_std(self) -> float:
        """sigma_V, the init std of V and P (the paper's eq. 22 set equal to the FFN's eq. 25):
        out var = v_dim s^2 * H knn * sigma_V^4 * pre_dim (dim s^2) * (1 + sigma_s^2), s = init_std."""
        lk, s2 = self.lookup, self.init_std**2
        reads = lk.heads * lk.knn
        var4 = ffn_output_var(self.n_layers, self.ffn_mult) / (
            self.v_dim * s2 * reads * self.pre_dim * self.dim * s2 * (1 + lk.score_std**2))
        return var4**0.25

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialize with the paper's init, e.g. after `to_empty()`. Layers are
        also initialized at construction, like torch.nn layers."""
        self._init_all_but_values()
        if self.expansion > 1:  # after to_empty() the buffer holds garbage: the map again, on its device
            self.address_rows.copy_(self._address_map(self.lookup.n_keys))
        self.values.init_scale = self.value_std() * self.v_dim**0.5  # the pool's init std: init_scale / sqrt(v_dim)
        self.values.init_weights()
        self.usage.reset()

    @torch.no_grad()
    def _init_all_but_values(self) -> None:
        if self.lookup.core.is_meta:  # built on the meta device: init_weights() runs after to_empty()
            return
        self.lookup.init_weights(self.init_std)  # calibrates lookup.score_std, which value_std() reads
        for lin in (self.pre_proj, self.value_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.pre_values.weight, mean=0.0, std=self.value_std())

    def flops_per_token(self) -> int:
        """Lookup + pre-value projection + the H*knn pre-value dots and value rows read + value projection."""
        reads = self.lookup.heads * self.lookup.knn
        return (self.lookup.flops_per_token() + 2 * self.dim * self.pre_dim + 2 * reads * (self.pre_dim + self.v_dim)
                + 2 * self.v_dim * self.dim)
