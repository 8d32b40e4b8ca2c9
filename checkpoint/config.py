"""The `checkpoint.*` section of the run config, beside the code that reads it (memlm.checkpoint.checkpointer).

    cfg.checkpoint.every           # steps between checkpoints (the checkpointer decides when to save)
    cfg.checkpoint.validate()      # each value's own range (config/run.py composes the sections)
"""

from __future__ import annotations

from dataclasses import dataclass

from memlm.errors import ConfigError


@dataclass
class CheckpointConfig:
    # Steps between checkpoints; 0 -> only at the end. Not 0 by default, so that the same
    # command (or a requeued Slurm job) resumes a killed run from a recent step.
    every: int = 500
    keep: int = 2  # newest checkpoints kept
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this; 0 -> none
    # Integrity data written with each checkpoint and checked before loading:
    # checksum (crc32 of every file) | size (file sizes only, for huge runs).
    verify: str = "checksum"
    at_end: bool = True
    # Stage tensors in host memory and write them in a background thread: training
    # is blocked only for the copy (for GPU runs with large states).
    async_save: bool = False
    # Count the memory slots' reads over the run's last N steps and write them beside the
    # final checkpoint (slot_usage.safetensors): the background of a later finetune=sparse
    # (docs/finetuning.md). 0 -> off.
    slot_usage_steps: int = 0

    def validate(self, prefix: str = "checkpoint") -> None:
        for key in ("every", "keep_every", "slot_usage_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "an integer >= 0")
        if self.keep < 1:
            raise ConfigError(f"{prefix}.keep", self.keep, "an integer >= 1 (the newest checkpoint is always kept)")
        if self.verify not in ("checksum", "size"):
            raise ConfigError(f"{prefix}.verify", self.verify, "one of: checksum, size")
