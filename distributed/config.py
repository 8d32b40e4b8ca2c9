"""The `parallel.*` section of the run config (configs/parallel/*.yaml), beside the code that reads it.

    cfg.parallel.memory_parallel   # auto or ranks per column-sharded value table (memlm.distributed.memory_hooks)
    cfg.parallel.validate()        # each value's own range (config/run.py composes the sections)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlm.errors import ConfigError


@dataclass
class ParallelConfig:
    # Ranks sharing one column-sharded value table: an integer, or auto (the
    # layout with the least value-table traffic for the world size the run
    # starts with; 1 on one rank or without value tables; memlm.distributed.memory_hooks).
    memory_parallel: Any = "auto"
    fsdp: str = "full"  # full | hybrid (shard within a node, replicate across nodes)
    activation_checkpoint: str = "none"  # none | full | selective
    compile: bool = False
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    # full: every rank initializes the whole model on CPU (identical weights for
    # any world size), then shards it; sharded: initialize each shard in place
    # on the device (for models too large for host memory).
    init: str = "full"
    # Seconds a collective waits for a peer rank before the run stops with one line naming this key
    # (the process group's timeout, gloo and NCCL; memlm.distributed.env, docs/errors.md).
    timeout_s: int = 600

    def validate(self, prefix: str = "parallel") -> None:
        mp = self.memory_parallel
        if mp != "auto" and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 1):
            raise ConfigError(f"{prefix}.memory_parallel", mp, "auto or an integer >= 1")
        if self.timeout_s < 1:
            raise ConfigError(f"{prefix}.timeout_s", self.timeout_s, "an integer >= 1 (seconds a collective waits "
                              "for a peer rank)")
        choices = {
            "fsdp": ("full", "hybrid"),
            "activation_checkpoint": ("none", "full", "selective"),
            "dtype": ("auto", "bf16", "fp32"),
            "init": ("full", "sharded"),
        }
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), f"one of: {', '.join(valid)}")
