"""Typed configuration of the data pipeline (the `data/` Hydra config group)."""

from __future__ import annotations

from dataclasses import dataclass

from memlm.errors import ConfigError


@dataclass
class DataConfig:
    name: str = "random"
    seq_len: int = 128
    micro_batch: int = 4
    seed: int = 0

    def validate(self, prefix: str = "data") -> None:
        for key in ("seq_len", "micro_batch"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "a positive integer")
