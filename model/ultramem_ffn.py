"""FFN kind "ultramem": UltraMemV2's memory layer in a block, beside a reduced SwiGLU.

    python -m memlm.train memory=ultramem ...        # configs/memory/ultramem.yaml: every block

The layer is memlm.memory.ultramem.UltraMemV2 (its docstring and docs/memory.md
give the math); this file adapts it to the FFN slot contract of model/ffn.py,
(batch, seq, dim) -> (batch, seq, dim), and declares its family:

- the block's output is memory(x) + ffn(x), the FFN's width the dense FFN's
  hidden size times `memory.ffn_fraction` (UltraMemV2's rebalanced memory-to-FFN
  ratio as one setting; 0: the memory alone);
- its value table V (a ValuePool) and pre-value table P are sparse tables: the
  value group's lr, weight decay and clip, and all that finetune=memory trains;
- its init is the paper's, matched to the output variance of the FFN beside it
  (n_layers and the FFN's width / dim);
- an export carries it in the remote modeling file (hf/remote/), so `transformers`
  loads it with `trust_remote_code=True`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlm.errors import ConfigError
from memlm.memory.ultramem import UltraMemV2, default_v_dim
from memlm.memory.values import VALUE_DTYPES
from memlm.model.family import Family, PoolShape, register_family
from memlm.model.ffn import FFNContext, SwiGLU


class UltraMemFFN(nn.Module):
    def __init__(self, memory: UltraMemV2, ffn: SwiGLU | None):
        super().__init__()
        self.memory = memory
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, dim) -> (batch, seq, dim)
        out = self.memory(x)
        return out if self.ffn is None else out + self.ffn(x)

    def init_weights(self, init_std: float, out_std: float) -> None:
        self.memory.init_weights()  # the paper's init (memory/ultramem.py), not the decoder's depth-scaled one
        if self.ffn is not None:
            self.ffn.init_weights(init_std, out_std)

    def flops_per_token(self) -> int:
        return self.memory.flops_per_token() + (self.ffn.flops_per_token() if self.ffn is not None else 0)

    def saved_bytes_per_token(self, compute_bytes: int, memory_parallel: int) -> int:
        """What one token's forward keeps for backward (the planner's activations): its input,
        the row and column queries, the pre-value projection, the bag output and its projection,
        the (rows, scores, pre-value dots) of its reads gathered over the memory-parallel group,
        and the SwiGLU beside it."""
        m, lk, a = self.memory, self.memory.lookup, compute_bytes
        reads = lk.heads * lk.knn
        kept = a * (m.dim + lk.heads * 2 * lk.rank * lk.k_dim + m.pre_dim + 2 * m.v_dim)
        kept += memory_parallel * reads * (8 + 4 + 4)  # int64 rows, float32 scores and dots
        if self.ffn is not None:
            kept += a * 4 * self.ffn.w1.out_features  # as SwiGLU's count in plan/cost.py
        return kept

    def inactive_params(self) -> int:
        """Rows of P a token does not read (V's are its ValuePool's to count: memory/values.py)."""
        reads = self.memory.lookup.heads * self.memory.lookup.knn
        return max(0, self.memory.n_rows - reads) * self.memory.pre_dim


def reduced_hidden(hidden_dim: int, fraction: float) -> int:
    """The SwiGLU width beside the memory: the dense FFN's times memory.ffn_fraction (0: no FFN)."""
    return int(round(hidden_dim * fraction))


@register_family
class UltraMemFamily(Family):
    kind, label = "ultramem", "UltraMemV2"
    holds_tables = product_keys = remote_code = True  # V and P: sparse tables; n_keys**2 grid addresses
    sparse_rows = True  # finetune=sparse selects rows of V and P (both read at the same rows)

    def build(self, ctx: FFNContext) -> nn.Module:
        cfg, args = ctx.memory, ctx.args
        hidden = reduced_hidden(args.hidden_dim, cfg.ffn_fraction)
        memory = UltraMemV2(
            args.dim, n_keys=cfg.n_keys, heads=cfg.heads, rank=cfg.rank, knn=cfg.knn, k_dim=cfg.k_dim,
            candidates=cfg.candidates or None, expansion=cfg.expansion, v_dim=cfg.v_dim or None,
            pre_dim=cfg.pre_dim or None, n_layers=args.n_layers, ffn_mult=max(hidden, 1) / args.dim,
            sparse_updates=cfg.sparse_updates, kernel=cfg.kernel, value_dtype=VALUE_DTYPES[cfg.value_dtype],
            layer_id=ctx.layer_id)
        return UltraMemFFN(memory, SwiGLU(args.dim, hidden) if hidden else None)

    def value_pools(self, memory: Any, args: Any) -> PoolShape:
        """V: one pool per layer of n_keys**2 / expansion rows, v_dim wide (UltraMemV2's default
        when 0), heads * knn rows read per token."""
        return PoolShape(tables=len(memory.resolved_layers(args.n_layers)), rows=memory.n_keys**2 // memory.expansion,
                         v_dim=memory.v_dim or default_v_dim(args.dim), reads_per_token=memory.heads * memory.knn)

    def validate(self, memory: Any, prefix: str = "memory") -> None:
        for key in ("n_keys", "heads", "rank", "knn", "k_dim", "expansion"):
            if getattr(memory, key) < 1:
                raise ConfigError(f"{prefix}.{key}", getattr(memory, key), "an integer >= 1")
        for key in ("candidates", "pre_dim", "v_dim"):
            if getattr(memory, key) < 0:
                raise ConfigError(f"{prefix}.{key}", getattr(memory, key), "0 (the layer's default) or an integer >= 1")
        slots = memory.n_keys**2
        if slots % memory.expansion:
            raise ConfigError(f"{prefix}.expansion", memory.expansion,
                              f"a divisor of memory.n_keys**2={slots:,} (grid addresses per table row)")
        candidates = memory.candidates or min(memory.knn, memory.n_keys)
        if candidates > memory.n_keys:
            raise ConfigError(f"{prefix}.candidates", memory.candidates,
                              f"0 (min(knn, n_keys)) or an integer in [1, memory.n_keys={memory.n_keys}]")
        if memory.knn > candidates**2:
            raise ConfigError(f"{prefix}.knn", memory.knn,
                              f"at most candidates**2={candidates**2} (memory.candidates={memory.candidates})")
        if not 0 <= memory.ffn_fraction <= 4:
            raise ConfigError(f"{prefix}.ffn_fraction", memory.ffn_fraction,
                              "a number in [0, 4]: the FFN beside the memory as a fraction of the dense FFN's width")
        if memory.value_dtype != "fp32":
            raise ConfigError(f"{prefix}.value_dtype", memory.value_dtype,
                              "fp32 with memory.kind=ultramem (bf16 tables are the product-key layers' so far)")
