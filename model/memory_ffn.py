"""FFN kinds "memory" and "memplus": product-key memory layers in decoder blocks.

The layers themselves live in memlm.memory (usable without this package);
this file only adapts them to the FFN slot contract of model/ffn.py:
(batch, seq, dim) -> (batch, seq, dim), `init_weights(init_std, out_std)`,
`flops_per_token()`.

- `memory.share_values=true`: one `ValuePool` per model, created by the first
  memory block and kept in `ctx.shared["memory_values"]`; the Transformer
  registers it once as `shared.memory_values` and initializes it.
- `memory.placement=parallel`: the block keeps its dense SwiGLU and adds the
  memory read: ffn(x) + memory(x).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlm.memory.config import MemoryConfig
from memlm.memory.fast.launches import read_launches
from memlm.memory.layers import Memory, MemoryPlus, ProductKeyMemory
from memlm.memory.schedule import apply_knn_schedule
from memlm.memory.values import VALUE_DTYPES, ValuePool
from memlm.model.family import Family, PoolShape, register_family
from memlm.model.ffn import FFNContext, SwiGLU

SHARED_POOL_KEY = "memory_values"


class MemoryFFN(nn.Module):
    """A memory layer in an FFN slot, optionally next to the dense FFN."""

    def __init__(self, memory: ProductKeyMemory, dense: nn.Module | None = None):
        super().__init__()
        self.memory = memory
        self.dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, dim) -> (batch, seq, dim)
        out = self.memory(x)
        if self.dense is not None:
            out = out + self.dense(x)
        return out

    def init_weights(self, init_std: float, out_std: float) -> None:
        # The memory keeps the published init (docs/memory.md, "The math, as implemented"),
        # not the decoder's depth-scaled one; the dense FFN uses the decoder's.
        self.memory.init_weights()
        if self.dense is not None:
            self.dense.init_weights(init_std, out_std)

    def flops_per_token(self) -> int:
        dense = self.dense.flops_per_token() if self.dense is not None else 0
        return self.memory.flops_per_token() + dense


def _value_pool(ctx: FFNContext, cfg: MemoryConfig, v_dim: int) -> ValuePool | None:
    """The model's shared pool (created on first use), or None for a per-layer table."""
    if not cfg.share_values:
        return None
    pool = ctx.shared.get(SHARED_POOL_KEY)
    if pool is None:
        pool = ValuePool(cfg.n_keys**2, v_dim, cfg.value_init_scale, VALUE_DTYPES[cfg.value_dtype])
        ctx.shared[SHARED_POOL_KEY] = pool
    return pool


def _build(ctx: FFNContext, kind: str) -> MemoryFFN:
    cfg = ctx.memory if ctx.memory is not None else MemoryConfig(kind=kind)
    dim = ctx.args.dim
    v_dim = cfg.v_dim or dim
    common = dict(
        n_keys=cfg.n_keys, heads=cfg.heads, knn=cfg.knn, k_dim=cfg.k_dim, v_dim=v_dim,
        values=_value_pool(ctx, cfg, v_dim), qk_norm=cfg.qk_norm, eval_knn=cfg.eval_knn,
        balance_loss_coef=cfg.balance_loss_coef, sparse_updates=cfg.sparse_updates,
        kernel=cfg.kernel, launches=read_launches(cfg.triton_algorithm, cfg.triton_forward, cfg.triton_backward),
        layer_id=ctx.layer_id, value_init_scale=cfg.value_init_scale,
        value_dtype=VALUE_DTYPES[cfg.value_dtype],
    )
    memory = (MemoryPlus(dim, gate=cfg.gate, bias=cfg.w_bias, **common) if kind == "memplus"
              else Memory(dim, **common))
    dense = SwiGLU(dim, ctx.args.hidden_dim) if cfg.placement == "parallel" else None
    return MemoryFFN(memory, dense)


class ProductKeyFamily(Family):
    """Product-key memory layers: value pools read by rows, a knn schedule, slot-usage health."""

    holds_tables = reads_rows = sparse_rows = product_keys = remote_code = True

    def build(self, ctx: FFNContext) -> nn.Module:
        return _build(ctx, self.kind)

    def value_pools(self, memory: Any, args: Any) -> PoolShape:
        layers = len(memory.resolved_layers(args.n_layers))
        return PoolShape(tables=1 if memory.share_values else layers, rows=memory.n_keys**2,
                         v_dim=memory.v_dim or args.dim, reads_per_token=memory.heads * memory.knn)

    def step_start(self, model: nn.Module, memory: Any, step: int) -> None:
        apply_knn_schedule(model, memory, step)


@register_family
class MemoryFamily(ProductKeyFamily):
    kind, label = "memory", "Memory"


@register_family
class MemoryPlusFamily(ProductKeyFamily):
    kind, label = "memplus", "Memory+"
