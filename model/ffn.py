"""The feed-forward slot of every block, and the registry that fills it.

A block never knows what its FFN is: the transformer asks `build_ffn(kind,
ctx)` for a module, which the kind's family builds (memlm.model.family). Dense
SwiGLU is registered here; memory layers, MoE and PEER register their own
families in their modules, so adding a variant never touches the block, the
transformer or the trainer.

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

from memlm.model.args import ModelArgs
from memlm.model.family import Family, families, family_of, register_family


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


def ffn_kinds() -> list[str]:
    return [f.kind for f in families()]


def table_kinds() -> list[str]:
    """The FFN kinds whose modules hold sparse tables (Family.holds_tables)."""
    return [f.kind for f in families() if f.holds_tables]


def build_ffn(kind: str, ctx: FFNContext) -> nn.Module:
    return family_of(kind).build(ctx)


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


@register_family
class Dense(Family):
    """Llama's SwiGLU FFN, the slot's default (model.ffn)."""

    kind, label = "dense", "Dense"
    llama_equivalent = remote_code = True

    def build(self, ctx: FFNContext) -> nn.Module:
        return SwiGLU(ctx.args.dim, ctx.args.hidden_dim)
