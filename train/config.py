"""The run configuration: typed dataclasses + Hydra config groups, composed in one place.

`compose(overrides)` is the single entry point used by the trainer, the tools
and the tests. It merges `configs/` with Hydra overrides, converts the result
into `Config` dataclasses and validates every value, so a bad value fails here,
before any process group, file or tensor is created.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

import memlm.model  # noqa: F401  (registers the FFN kinds that validation lists)
from memlm.data.config import DataConfig
from memlm.errors import ConfigError
from memlm.evals.config import EvalConfig
from memlm.memory.config import MemoryConfig
from memlm.model.args import ModelArgs
from memlm.model.ffn import ffn_kinds

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "memory", "data", "optim", "parallel", "eval", "experiment")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | linear | constant | wsd
    warmup: int = 10
    min_lr_ratio: float = 0.1
    clip: float = 1.0

    def validate(self, prefix: str = "optim") -> None:
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr", self.lr, "a positive number")
        if self.schedule not in ("cosine", "linear", "constant", "wsd"):
            raise ConfigError(f"{prefix}.schedule", self.schedule, "one of: cosine, linear, constant, wsd")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "a number in [0, 1)")
        if self.warmup < 0:
            raise ConfigError(f"{prefix}.warmup", self.warmup, "an integer >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{prefix}.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")


@dataclass
class ParallelConfig:
    memory_parallel: int = 1  # ranks sharing one column-sharded value table
    fsdp: str = "full"  # full | hybrid (shard within a node, replicate across nodes)
    activation_checkpoint: str = "none"  # none | full | selective
    compile: bool = False
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32

    def validate(self, prefix: str = "parallel") -> None:
        if self.memory_parallel < 1:
            raise ConfigError(f"{prefix}.memory_parallel", self.memory_parallel, "an integer >= 1")
        choices = {
            "fsdp": ("full", "hybrid"),
            "activation_checkpoint": ("none", "full", "selective"),
            "dtype": ("auto", "bf16", "fp32"),
        }
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), f"one of: {', '.join(valid)}")


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    name: str = "run"
    dump_dir: str = "runs/${name}"
    steps: int = 100
    seed: int = 0

    def validate(self) -> None:
        self.model.validate(ffn_kinds())
        self.memory.validate(self.model.n_layers)
        if self.memory.kind != "none" and self.memory.kind not in ffn_kinds():
            raise ConfigError("memory.kind", self.memory.kind, f"none or one of the FFN kinds: {', '.join(ffn_kinds())}")
        v_dim = self.memory.v_dim or self.model.dim
        if self.memory.kind != "none" and v_dim % self.parallel.memory_parallel:
            raise ConfigError(
                "memory.v_dim", v_dim,
                f"a multiple of parallel.memory_parallel={self.parallel.memory_parallel} "
                "(the value table is split by columns over the memory-parallel ranks)",
            )
        self.data.validate()
        self.optim.validate()
        self.parallel.validate()
        self.eval.validate()
        if self.steps < 0:
            raise ConfigError("steps", self.steps, "an integer >= 0")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                "data.seq_len", self.data.seq_len,
                f"at most model.max_seq_len={self.model.max_seq_len}",
            )


def _register_schemas() -> None:
    """Register the dataclasses as Hydra structured configs (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="memlm_config_schema", node=Config)


def group_options(group: str) -> list[str]:
    """The presets of one config group, e.g. group_options("model") -> ["134m", ...]."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def compose_dict(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose the raw (typed, resolved) DictConfig; `compose` is what most callers want."""
    _register_schemas()
    overrides = list(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="memlm"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except MissingConfigException as err:
        raise _missing_option_error(overrides, err) from None
    except HydraException as err:
        detail = f"{err} ({err.__cause__})" if err.__cause__ else str(err)
        raise ConfigError("overrides", overrides, f"a valid Hydra override list; Hydra said: {detail}") from None
    OmegaConf.resolve(cfg)
    return cfg


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> Config:
    """Compose configs/ + overrides into a validated `Config`."""
    cfg = compose_dict(overrides, config_name)
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config)
    config.validate()
    return config


def _missing_option_error(overrides: list[str], err: MissingConfigException) -> ConfigError:
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in GROUPS and value and value not in group_options(key):
            return ConfigError(key, value, f"one of the presets in configs/{key}/: {', '.join(group_options(key))}")
    return ConfigError("overrides", overrides, str(err))


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
