"""The feed-forward slot of every block, and the registry that fills it.

A block never knows what its FFN is: the transformer asks `build_ffn(kind,
ctx)` for a module. Dense SwiGLU is registered here; memory layers, MoE and
PEER register their own kinds in their modules, so adding a variant never
touches the block or the transformer.

Every FFN module maps (batch, seq, dim) -> (batch, seq, dim) and provides
`init_weights(init_std, out_std)` and `flops_per_token()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memlm.errors import ConfigError
from memlm.model.args import ModelArgs


@dataclass
class FFNContext:
    """What a builder may use: the model's args, the block index, the memory
    config (None for plain models), and `shared`, a per-model dict where
    builders keep objects several blocks share (e.g. a memory value pool).
    Modules put there are registered once on the transformer as `shared.<name>`."""

    args: ModelArgs
    layer_id: int
    memory: Any = None
    shared: dict[str, Any] = field(default_factory=dict)


FFNBuilder = Callable[[FFNContext], nn.Module]

# Filled at import time by `register_ffn`; read-only afterwards.
_BUILDERS: dict[str, FFNBuilder] = {}
_TABLE_KINDS: set[str] = set()


def register_ffn(kind: str, sparse_tables: bool = False) -> Callable[[FFNBuilder], FFNBuilder]:
    """`sparse_tables`: the kind's modules hold sparse tables (memlm.memory.tables: a value pool,
    PEER's experts), the only weights finetune=memory trains."""
    def decorate(builder: FFNBuilder) -> FFNBuilder:
        if kind in _BUILDERS and _BUILDERS[kind] is not builder:
            raise ValueError(f"FFN kind {kind!r} is already registered")
        _BUILDERS[kind] = builder
        if sparse_tables:
            _TABLE_KINDS.add(kind)
        return builder

    return decorate


def ffn_kinds() -> list[str]:
    return sorted(_BUILDERS)


def table_kinds() -> list[str]:
    """The FFN kinds whose modules hold sparse tables (registered with sparse_tables=True)."""
    return sorted(_TABLE_KINDS)


def build_ffn(kind: str, ctx: FFNContext) -> nn.Module:
    if kind not in _BUILDERS:
        raise ConfigError("ffn kind", kind, f"one of: {', '.join(ffn_kinds())}")
    return _BUILDERS[kind](ctx)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), Llama's feed-forward network."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=out_std, a=-3 * out_std, b=3 * out_std)

    def flops_per_token(self) -> int:
        return 2 * 3 * self.w1.in_features * self.w1.out_features


@register_ffn("dense")
def _build_dense(ctx: FFNContext) -> nn.Module:
    return SwiGLU(ctx.args.dim, ctx.args.hidden_dim)
