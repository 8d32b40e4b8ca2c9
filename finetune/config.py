"""The `finetune.*` section of the run config (configs/finetune/*.yaml; docs/finetuning.md).

    cfg.finetune.mode         # full | memory | sparse | lora: memlm.finetune.modes.MODES
    mode_of(cfg).validate(cfg)  # what the mode needs and refuses (memlm.finetune.modes)

Each field's own range is checked here; what a mode reads, needs from the
model and refuses is the mode object's (memlm.finetune.modes), so a setting the
chosen mode would ignore is refused, naming the modes that read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memlm.errors import ConfigError
from memlm.memory.slot_selection import RANKINGS
from memlm.model.lora import TARGETS as LORA_TARGETS

OPTIMIZERS = ("adamw", "sgd")  # of the value tables, for the modes that train them


@dataclass
class FinetuneConfig:
    """What trains. full: every parameter (pretraining). memory: only the
    memory's value tables; every other parameter frozen (no gradient, no
    optimizer state, bitwise unchanged). sparse: only the `top_t` rows of each
    value table that the step's batch reads most above the background
    (memory/slot_selection.py). lora: low-rank adapters (model/lora.py)."""

    mode: str = "full"  # one of memlm.finetune.modes.MODES
    top_t: int = 1000  # sparse: value rows of each table updated per step
    ranking: str = "kl"  # sparse: kl | tfidf | tfidf_batches (memory/slot_selection.py)
    # sparse: the background's slot reads (python -m memlm.train.slot_usage);
    # "" -> slot_usage.safetensors in the init_from checkpoint folder.
    background: str = ""
    # memory, sparse: the value tables' optimizer (memory.value_lr, memory.value_weight_decay): adamw | sgd
    optimizer: str = "adamw"
    # lora: adapters of this rank on the projections named (attention wq wk wv wo, dense FFN w1 w2 w3),
    # output scaled by lora_alpha / lora_rank; trained with optim.* (model/lora.py)
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    def validate(self, prefix: str = "finetune") -> None:
        """Each value's own range; `mode` is the modes' to check (memlm.finetune.modes.mode_of)."""
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"{prefix}.optimizer", self.optimizer, f"one of: {', '.join(OPTIMIZERS)}")
        if self.ranking not in RANKINGS:
            raise ConfigError(f"{prefix}.ranking", self.ranking, f"one of: {', '.join(RANKINGS)}")
        if self.top_t < 1:
            raise ConfigError(f"{prefix}.top_t", self.top_t, "an integer >= 1 (value rows per table per step)")
        if self.lora_rank < 1:
            raise ConfigError(f"{prefix}.lora_rank", self.lora_rank, "an integer >= 1")
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"{prefix}.lora_alpha", self.lora_alpha, "a finite number > 0")
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad or not self.lora_targets:
            raise ConfigError(f"{prefix}.lora_targets", list(self.lora_targets),
                              f"a non-empty list of: {', '.join(LORA_TARGETS)}")
