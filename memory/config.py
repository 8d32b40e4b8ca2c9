"""Typed configuration of the memory layers (the `memory/` Hydra config group).

`kind` chooses what replaces the feed-forward network in the blocks listed by
`layers`; `none` keeps every block dense. The defaults are the published
Memory+ settings (see MEMORY_LAYERS.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memlm.errors import ConfigError


@dataclass
class MemoryConfig:
    # FFN kind placed in the memory blocks: none | memory | memplus (later: moe | peer).
    kind: str = "none"
    # Block indices that get a memory layer. Empty with `spread > 0` means
    # `spread` layers evenly through the depth (24 layers, spread 3 -> 4,12,20).
    layers: list[int] = field(default_factory=list)
    spread: int = 0
    n_keys: int = 1024
    heads: int = 4
    knn: int = 32
    eval_knn: int = 32
    k_dim: int = 512
    v_dim: int = 0  # 0 -> the model dim
    share_values: bool = True
    qk_norm: bool = False
    gate: str = "swilu"  # none | sigmoid | swilu
    placement: str = "replace"  # replace | parallel
    value_lr: float = 1e-3
    value_weight_decay: float = 0.0
    value_grad_clip: float = 1.0
    balance_loss_coef: float = 0.0
    sparse_updates: bool = False
    kernel: str = "auto"  # auto | triton | torch

    def resolved_layers(self, n_layers: int) -> list[int]:
        """The block indices that hold a memory layer in an `n_layers`-deep model."""
        if self.kind == "none":
            return []
        if self.layers:
            return sorted(self.layers)
        if self.spread > 0:
            # Evenly spaced, centred in equal segments: 24 layers, 3 -> 4, 12, 20.
            seg = n_layers / self.spread
            return sorted({int(seg * i + seg / 2) for i in range(self.spread)})
        return []

    def validate(self, n_layers: int, prefix: str = "memory") -> None:
        """Check values that do not depend on a particular layer implementation."""
        if self.kind == "none":
            return
        for idx in self.layers:
            if not 0 <= idx < n_layers:
                raise ConfigError(
                    f"{prefix}.layers", list(self.layers),
                    f"every index must lie in [0, {n_layers - 1}] (model.n_layers={n_layers})",
                )
        if self.spread < 0 or self.spread > n_layers:
            raise ConfigError(f"{prefix}.spread", self.spread, f"an integer in [0, {n_layers}]")
        if not self.resolved_layers(n_layers):
            raise ConfigError(
                f"{prefix}.layers", list(self.layers),
                f"memory.kind={self.kind!r} needs at least one layer: set memory.layers or memory.spread",
            )
        if self.placement not in ("replace", "parallel"):
            raise ConfigError(f"{prefix}.placement", self.placement, "one of: replace, parallel")
        if self.gate not in ("none", "sigmoid", "swilu"):
            raise ConfigError(f"{prefix}.gate", self.gate, "one of: none, sigmoid, swilu")
        if self.kernel not in ("auto", "triton", "torch"):
            raise ConfigError(f"{prefix}.kernel", self.kernel, "one of: auto, triton, torch")
