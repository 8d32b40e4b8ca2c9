"""Typed configuration of the evaluation suite (the `eval/` Hydra config group)."""

from __future__ import annotations

from dataclasses import dataclass, field

from memlm.errors import ConfigError


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    data_dir: str = ""
    num_fewshot: int = 5
    limit: int = 0  # 0 -> every example
    after_training: bool = False
    every: int = 0  # 0 -> only after training

    def validate(self, prefix: str = "eval") -> None:
        for key in ("num_fewshot", "limit", "every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "an integer >= 0")
