"""Typed configuration of the decoder (the `model/` Hydra config group)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from memlm.errors import ConfigError
from memlm.model.doc_mask import BACKENDS as DOC_MASK_BACKENDS


@dataclass
class ModelArgs:
    name: str = "tiny"  # preset name, informational
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 -> n_heads (multi-head attention)
    vocab_size: int = 512
    # SwiGLU hidden size. 0 -> Llama's rule from dim, multiple_of, ffn_dim_multiplier.
    ffn_hidden_dim: int = 0
    multiple_of: int = 256
    ffn_dim_multiplier: float = 1.0
    ffn: str = "dense"  # FFN kind of every block not replaced by the memory config
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Scale the init of each block's output projections by 1/sqrt(2 * (layer + 1)).
    depth_init: bool = True
    # Packed training rows: attention stops at document boundaries (memlm.model.doc_mask);
    # the loader supplies document ids. Inference (one document per row) is unchanged.
    doc_mask: bool = False
    # With doc_mask: RoPE positions restart at 0 at each document's first token in a row.
    rope_restart: bool = False
    doc_mask_backend: str = "auto"  # auto (flex on CUDA, sdpa elsewhere) | flex | sdpa

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: explicit, or Llama's 2/3 * 4 * dim rounded up to multiple_of."""
        if self.ffn_hidden_dim > 0:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self, ffn_kinds: list[str], prefix: str = "model") -> None:
        positive = ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "a positive integer")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"{prefix}.dim", self.dim,
                f"a multiple of model.n_heads={self.n_heads} (each head gets dim/n_heads channels)",
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"{prefix}.dim", self.dim,
                f"dim/n_heads must be even for rotary embeddings (got {self.head_dim})",
            )
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            divisors = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            raise ConfigError(
                f"{prefix}.n_kv_heads", self.n_kv_heads,
                f"0 (= n_heads) or a divisor of model.n_heads={self.n_heads}: {divisors}",
            )
        if self.ffn not in ffn_kinds:
            raise ConfigError(f"{prefix}.ffn", self.ffn, f"one of the FFN kinds: {', '.join(ffn_kinds)}")
        if self.ffn_hidden_dim < 0:
            raise ConfigError(f"{prefix}.ffn_hidden_dim", self.ffn_hidden_dim, "0 (Llama rule) or a positive integer")
        if self.ffn_dim_multiplier <= 0:
            raise ConfigError(f"{prefix}.ffn_dim_multiplier", self.ffn_dim_multiplier, "a positive number")
        if self.norm_eps <= 0:
            raise ConfigError(f"{prefix}.norm_eps", self.norm_eps, "a positive number")
        if self.rope_theta <= 0:
            raise ConfigError(f"{prefix}.rope_theta", self.rope_theta, "a positive number")
        if self.rope_restart and not self.doc_mask:
            raise ConfigError(f"{prefix}.rope_restart", self.rope_restart,
                              f"false unless {prefix}.doc_mask=true (positions restart at the document "
                              "boundaries the document mask uses)")
        if self.doc_mask_backend not in DOC_MASK_BACKENDS:
            raise ConfigError(f"{prefix}.doc_mask_backend", self.doc_mask_backend,
                              f"one of: {', '.join(DOC_MASK_BACKENDS)}")
        if self.init_std <= 0:
            raise ConfigError(f"{prefix}.init_std", self.init_std, "a positive number")
