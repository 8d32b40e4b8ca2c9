"""Engram: hashed n-gram memory with a context-aware gate, a module that stands alone in any model.

From "Conditional Memory via Scalable Lookup" (DeepSeek-AI and Peking University, 2026),
written from its equations (docs/memory.md, "Engram"):

    from memlm.memory.engram import Engram
    from memlm.memory.engram_vocab import canonical_map
    engram = Engram(dim=512, token_map=canonical_map(pieces), layer=1)   # pieces: the tokenizer's, in id order
    h = h + engram(h, tokens)   # h (B, T, 512) the residual stream before attention, tokens (B, T) int64
    rows = engram.hash(tokens)  # (B, T, H) int64, H = (max_order - 1) * heads: known before the forward
    h = h + engram(h, rows=rows)                 # the same output from rows computed ahead
    state = engram.new_state(batch=B, max_len=64)             # incremental decoding: what the layer keeps
    y = engram(h[:, :5], tokens[:, :5], state=state)          # positions 0..4, then 5, 6, ...: the
    y = engram(h[:, 5:6], tokens[:, 5:6], state=state, start=5)   # same outputs as the whole sequence

Per position t (E = H * head_dim; memlm.memory.engram_hash gives the rows):
    e_t = concat_j table[rows[t, j]]                       # (E,)   the memory vector, heads concatenated
    k_t, v_t = W_k e_t, W_v e_t                            # (dim,) each, no bias
    a_t = sigmoid(ssqrt(<norm_k(k_t), norm_h(h_t)> / sqrt(dim)))   # scalar gate (signed_sqrt below)
    u_t = a_t * v_t                                        # (dim,) the gated value
    y_t = u_t + silu(sum_j w[:, j] * norm_c(u)_{t - (w-1-j) * dil})   # depthwise causal conv, zeros before 0
    returns y (B, T, dim): the caller adds it to the residual stream
norm_*: RMSNorm with a learned weight (eps: the dtype's). dil defaults to max_order.

The n-gram tables are one (sum of the heads' primes, head_dim) value pool,
`EngramTables` (memlm.memory.values.ValuePool: memlm.memory.tables finds it); the
hasher's per-head offsets address it. One tensor, like Memory+'s value pool:
one read for all heads, one sparse row update, one column split. `sparse`
(memory.sparse_updates) and `kernel` (memory.kernel) choose how it is read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from memlm.memory.engram_config import engram_size_problem
from memlm.memory.engram_hash import NgramHash
from memlm.memory.engram_vocab import check_canonical_map
from memlm.memory.usage import SlotUsage
from memlm.memory.values import ValuePool

SSQRT_EPS = 1e-6  # |x| is clamped here inside the gate's signed square root: a finite slope at 0


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    """sign(x) * sqrt(max(|x|, SSQRT_EPS)): 0 at 0, slope at most 1 / (2 sqrt(SSQRT_EPS)) = 500."""
    return torch.sign(x) * torch.sqrt(x.abs().clamp_min(SSQRT_EPS))


class EngramTables(ValuePool):
    """Every head's n-gram table in one (n_rows, head_dim) value pool; row = head offset + hashed id.

    A pool (memory/values.py) read as a bag of one row per (position, head) at weight 1, so the
    house treats it as Memory+'s values: memory parallelism shards it by columns, its reads add
    into the table's gradient buffer, memory.sparse_updates gives it row gradients, and a run draws
    it from the seed alone. Init: std head_dim**-0.5 (the pool's), rows of unit expected norm."""

    def __init__(self, n_rows: int, head_dim: int, heads: int):
        super().__init__(n_rows, head_dim)
        for _ in range(heads):  # each head a reader of one row per token: H rows in all (active parameters)
            self.add_reader(1)

    def forward(self, rows: torch.Tensor, sparse: bool = False, kernel: str = "auto") -> torch.Tensor:
        """rows (B, T, H) int64 -> e (B, T, H * head_dim): the heads' rows concatenated."""
        flat = rows.reshape(-1, 1)  # (B T H, 1): one bag per (position, head)
        ones = torch.ones(flat.shape, dtype=torch.float32, device=rows.device)
        return self.read(flat, ones, sparse=sparse, kernel=kernel).view(*rows.shape[:-1], -1)


class EngramState:
    """What incremental decoding keeps for one Engram layer: every position's token id and conv input
    so far, so the n-grams and the convolution of new positions reach back exactly (max_len positions)."""

    def __init__(self, batch: int, max_len: int, dim: int, device: torch.device | str | None = None):
        self.tokens = torch.zeros(batch, max_len, dtype=torch.int64, device=device)  # (B, max_len)
        self.conv_in = None  # (B, max_len, dim), allocated at the first write in the dtype the layer computes in
        self.shape = (batch, max_len, dim)
        self.device = device

    def write_conv_in(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Store x (B, T, dim) at positions start.. and return every conv input so far (B, start + T, dim)."""
        if self.conv_in is None:
            self.conv_in = torch.zeros(self.shape, dtype=x.dtype, device=self.device)
        end = start + x.shape[1]
        self.conv_in[:, start:end] = x
        return self.conv_in[:, :end]


class Engram(nn.Module):
    """Hashed n-gram memory gated by the hidden state (module docstring). Output: the residual delta."""

    def __init__(self, dim: int, token_map: torch.Tensor, layer: int, seed: int = 0, max_order: int = 3,
                 heads: int = 8, head_dim: int = 64, rows_per_head: int | Sequence[int] | None = None,
                 kernel_size: int = 4, dilation: int | None = None, sparse: bool = False, kernel: str = "auto"):
        super().__init__()
        token_map = check_canonical_map(token_map, "token_map")
        if rows_per_head is None:  # five times the canonical vocabulary per head, as the public demo sizes it
            rows_per_head = 5 * (int(token_map.max()) + 1)
        dilation = max_order if dilation is None else dilation
        problem = engram_size_problem(dim, max_order, heads, head_dim, rows_per_head, kernel_size, dilation,
                                      seed, layer)
        if problem is not None:
            key, value, valid = problem
            raise ValueError(f"{key}={value!r} is invalid: {valid}")
        if isinstance(rows_per_head, int):
            rows_per_head = [rows_per_head] * (max_order - 1)
        self.dim, self.head_dim, self.kernel_size, self.dilation = dim, head_dim, kernel_size, dilation
        self.hash = NgramHash(token_map, max_order, heads, rows_per_head, seed, layer)
        self.n_heads = len(self.hash.head_rows)  # H = (max_order - 1) * heads
        self.mem_dim = self.n_heads * head_dim  # E
        self.tables = EngramTables(self.hash.n_rows, head_dim, self.n_heads)
        self.sparse, self.kernel = sparse, kernel  # how the tables are read (EngramTables.forward)
        # Reads per table row in training (memlm.memory.usage: health metrics, finetune=sparse's counts),
        # named apart from a memory FFN in the same block.
        self.usage = SlotUsage(self.hash.n_rows)
        self.usage_name = f"engram{layer}"
        self.w_k = nn.Linear(self.mem_dim, dim, bias=False)
        self.w_v = nn.Linear(self.mem_dim, dim, bias=False)
        self.norm_k = nn.Parameter(torch.empty(dim))  # RMSNorm weights: the key, the hidden state, the conv input
        self.norm_h = nn.Parameter(torch.empty(dim))
        self.norm_c = nn.Parameter(torch.empty(dim))
        self.conv = nn.Parameter(torch.empty(dim, kernel_size))  # depthwise taps; [:, -1] is position t itself
        self._init_dense()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialize everything, e.g. after `to_empty()` (like torch.nn layers, also at construction)."""
        self.hash.init_buffers()
        self.tables.init_weights()
        self.usage.reset()
        self._init_dense()

    @torch.no_grad()
    def _init_dense(self) -> None:
        for lin in (self.w_k, self.w_v):
            nn.init.normal_(lin.weight, mean=0.0, std=self.mem_dim**-0.5)
        for norm in (self.norm_k, self.norm_h, self.norm_c):
            nn.init.ones_(norm)
        nn.init.zeros_(self.conv)  # y = u at step 0: the convolution starts as no change

    @property
    def values(self) -> EngramTables:
        """The value pool its rows address (what finetune=sparse groups layers by)."""
        return self.tables

    def row_tables(self) -> list[nn.Parameter]:
        """The tables whose rows `usage` counts (finetune=sparse selects among them)."""
        return [self.tables.weight]

    def new_state(self, batch: int, max_len: int, device: torch.device | str | None = None) -> EngramState:
        """An empty decoding state for `batch` rows of up to `max_len` positions (on the table's device)."""
        return EngramState(batch, max_len, self.dim, device or self.tables.weight.device)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor | None = None, *,
                rows: torch.Tensor | None = None, state: EngramState | None = None, start: int = 0) -> torch.Tensor:
        """h (B, T, dim), and tokens (B, T) or their rows (B, T, H) -> y (B, T, dim).
        With `state` (incremental decoding; tokens only): h and tokens are positions start..start+T-1
        after the `start` positions already passed through this state."""
        if (tokens is None) == (rows is None):
            raise ValueError("Engram needs exactly one of tokens= (B, T) and rows= (B, T, H) from engram.hash")
        if state is not None:
            if tokens is None or start < 0 or start + h.shape[1] > state.tokens.shape[1]:
                raise ValueError(f"start={start} with {h.shape[1]} new positions and a state of "
                                 f"{state.tokens.shape[1]} is invalid: tokens= (not rows=) and "
                                 "0 <= start <= start + T <= the state's max_len")
            rows = self._rows_after(tokens, state, start)
        elif rows is None:
            rows = self.hash(tokens)
        if h.dim() != 3 or h.shape[-1] != self.dim or tuple(rows.shape) != (*h.shape[:2], self.n_heads):
            raise ValueError(f"h {tuple(h.shape)} with rows {tuple(rows.shape)} is invalid: "
                             f"h (B, T, dim={self.dim}) and rows (B, T, H={self.n_heads}) of the same B, T")
        if self.training:
            self.usage.record(rows)
        e = self.tables(rows, self.sparse, self.kernel)  # (B, T, E)
        k, v = self.w_k(e), self.w_v(e)  # (B, T, dim) each
        eps = torch.finfo(h.dtype).eps
        dot = (F.rms_norm(k, (self.dim,), self.norm_k, eps) * F.rms_norm(h, (self.dim,), self.norm_h, eps)).sum(-1)
        gate = torch.sigmoid(signed_sqrt(dot / math.sqrt(self.dim)))  # (B, T)
        u = gate.unsqueeze(-1) * v  # (B, T, dim)
        conv_in = F.rms_norm(u, (self.dim,), self.norm_c, eps)  # (B, T, dim)
        if state is None:
            return u + F.silu(self._causal_conv(conv_in))
        past = state.write_conv_in(conv_in, start)  # (B, start + T, dim): every input the taps may reach
        first = max(0, start - (self.kernel_size - 1) * self.dilation)
        return u + F.silu(self._causal_conv(past[:, first:])[:, start - first:])

    def _rows_after(self, tokens: torch.Tensor, state: EngramState, start: int) -> torch.Tensor:
        """The rows of positions start.. of tokens (B, T), their n-grams reaching into the state's earlier
        tokens: hashed over a window from max_order - 1 positions back (from 0, padded as usual, when
        fewer came before), the window's first positions dropped."""
        end = start + tokens.shape[1]
        state.tokens[:, start:end] = tokens
        first = max(0, start - (self.hash.max_order - 1))
        return self.hash(state.tokens[:, first:end])[:, start - first:]

    def _causal_conv(self, x: torch.Tensor) -> torch.Tensor:
        """Depthwise causal dilated conv over T: out_t = sum_j conv[:, j] * x_{t - (w-1-j) * dil} (zeros before 0).
        Written as w shifted multiply-adds, tap 0 first: the reference's order (conv1d rounds differently)."""
        seq = x.shape[1]
        out = None
        for j in range(self.kernel_size):
            back = (self.kernel_size - 1 - j) * self.dilation
            shifted = F.pad(x, (0, 0, back, 0))[:, :seq] if back else x  # x_{t - back}, (B, T, dim)
            term = self.conv[:, j] * shifted
            out = term if out is None else out + term
        return out

    def flops_per_token(self) -> int:
        """Forward FLOPs per token: the key and value projections (2 x 2 E dim) and the conv taps (2 w dim);
        the gather, the norms, the gate and the SiLU are left out, as the other layers' counts leave theirs."""
        return 4 * self.mem_dim * self.dim + 2 * self.kernel_size * self.dim

    def saved_bytes_per_token(self, act_bytes: int) -> int:
        """What a forward keeps for the backward per token, at `act_bytes` per activation: the rows
        (int64, H), the memory vector (E), and about six dim-wide tensors (k, v, their norms, u, the
        conv input and output)."""
        return 8 * self.n_heads + act_bytes * (self.mem_dim + 6 * self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.n_heads}, head_dim={self.head_dim}, " \
               f"kernel_size={self.kernel_size}, dilation={self.dilation}"
