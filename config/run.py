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
from memlm.checkpoint.config import CheckpointConfig
from memlm.config.eval import EvalConfig
from memlm.config.keys import unknown_key_error
from memlm.data.config import KINDS as DATA_KINDS
from memlm.data.config import DataConfig
from memlm.distributed.config import ParallelConfig
from memlm.errors import ConfigError, check_number
from memlm.finetune.config import FinetuneConfig
from memlm.finetune.modes import mode_of
from memlm.memory.config import MemoryConfig
from memlm.model.args import ModelArgs
from memlm.model.family import memory_family
from memlm.model.ffn import ffn_kinds

__all__ = ["CheckpointConfig", "Config", "OptimConfig", "ParallelConfig", "compose", "from_yaml", "to_yaml"]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "memory", "data", "optim", "parallel", "eval", "finetune", "experiment")
HF_PREFIX = "hf:"  # init_from=hf:<dir>: a Hugging Face Llama, or an export read as one (memlm.run.source)


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
    decay_fraction: float = 0.2  # wsd: share of the steps spent in the final decay
    clip: float = 1.0  # global gradient-norm clip of all non-memory-value weights; 0 -> off

    def validate(self, prefix: str = "optim") -> None:
        check_number(f"{prefix}.lr", self.lr)
        check_number(f"{prefix}.eps", self.eps)
        check_number(f"{prefix}.clip", self.clip, zero="no clipping")
        check_number(f"{prefix}.weight_decay", self.weight_decay, zero="no weight decay")
        if self.schedule not in ("cosine", "linear", "constant", "wsd"):
            raise ConfigError(f"{prefix}.schedule", self.schedule, "one of: cosine, linear, constant, wsd")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "a number in [0, 1)")
        if self.warmup < 0:
            raise ConfigError(f"{prefix}.warmup", self.warmup, "an integer >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{prefix}.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"{prefix}.decay_fraction", self.decay_fraction, "a number in (0, 1]")


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "memlm"
    entity: str = ""
    tags: list[str] = field(default_factory=list)

    def validate(self, prefix: str = "logging.wandb") -> None:
        if self.mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"{prefix}.mode", self.mode, "one of: offline, online, disabled")


@dataclass
class LoggingConfig:
    every: int = 10  # steps between console / metrics.jsonl lines
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Also write every metrics record's scalars (those wandb gets) as TensorBoard
    # events to dump_dir/tensorboard (needs the tensorboard package: memlm[tensorboard]).
    tensorboard: bool = False

    def validate(self, prefix: str = "logging") -> None:
        if self.every < 1:
            raise ConfigError(f"{prefix}.every", self.every, "an integer >= 1")
        self.wandb.validate(f"{prefix}.wandb")


@dataclass
class ProfileConfig:
    # [first, last] training steps (as logged, from 1; inclusive) to record with
    # torch.profiler (+ a CUDA memory snapshot) into dump_dir/profile/; [] -> off.
    steps: list[int] = field(default_factory=list)

    def validate(self, total_steps: int, prefix: str = "profile") -> None:
        s = list(self.steps)
        if s and not (len(s) == 2 and 1 <= s[0] <= s[1] <= total_steps):
            raise ConfigError(f"{prefix}.steps", s, f"[] (off) or [first, last] with 1 <= first <= last <= "
                              f"steps={total_steps}")


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    # auto (default: the newest complete checkpoint in dump_dir, if any; else a fresh start)
    # | none (start over: existing checkpoints are moved aside) | a checkpoint directory
    resume: str = "auto"
    # A checkpoint directory or a memlm export: load its weights only, fresh optimizer.
    # `hf:<dir>`: a Hugging Face Llama checkpoint, or an export (run/importer.py;
    # docs/checkpoints.md).
    init_from: str = ""
    name: str = "run"
    dump_dir: str = "runs/${name}"
    steps: int = 100
    seed: int = 0
    # Tokens per optimizer step over all ranks; 0 -> one micro-batch per rank
    # (no accumulation). Must be a multiple of micro_batch * seq_len * dp ranks.
    global_batch_tokens: int = 0
    val_every: int = 0  # steps between validation losses; 0 -> only at the end
    val_batches: int = 4
    # Stop after this many consecutive non-finite losses (each is skipped and counted).
    max_nonfinite_steps: int = 5
    device: str = "auto"  # auto (cuda if available) | cpu | cuda

    def micro_batch_tokens(self, world: int) -> int:
        """Tokens one micro-batch holds over `world` data-parallel ranks."""
        return self.data.micro_batch * self.data.seq_len * world

    def accumulation_steps(self, world: int) -> int:
        """Micro-batches per optimizer step on `world` data-parallel ranks (ConfigError when
        global_batch_tokens is no multiple of one micro-batch over the ranks)."""
        per_micro = self.micro_batch_tokens(world)
        if self.global_batch_tokens == 0:
            return 1
        if self.global_batch_tokens % per_micro:
            raise ConfigError(
                "global_batch_tokens", self.global_batch_tokens,
                f"a multiple of data.micro_batch x data.seq_len x data-parallel ranks = "
                f"{self.data.micro_batch} x {self.data.seq_len} x {world} = {per_micro}",
            )
        return self.global_batch_tokens // per_micro

    def tokens_per_step(self, world: int) -> int:
        """Tokens one optimizer step trains on over `world` data-parallel ranks."""
        return self.accumulation_steps(world) * self.micro_batch_tokens(world)

    def validate(self) -> None:
        self.model.validate(ffn_kinds())
        self.memory.validate(self.model.n_layers)
        self.memory.engram.validate(self.model.n_layers, self.model.dim, self.model.vocab_size)
        if self.memory.kind != "none" and self.memory.kind not in ffn_kinds():
            raise ConfigError("memory.kind", self.memory.kind,
                              f"none or one of the FFN kinds: {', '.join(ffn_kinds())}")
        if (fam := memory_family(self.memory)) is not None:
            fam.validate(self.memory)  # its own keys of the section (memlm.model.family)
        v_dim = self.memory.v_dim or self.model.dim
        mp = self.parallel.memory_parallel
        if self.memory.kind != "none" and mp != "auto" and v_dim % mp:
            raise ConfigError(
                "memory.v_dim", v_dim,
                f"a multiple of parallel.memory_parallel={self.parallel.memory_parallel} "
                "(the value table is split by columns over the memory-parallel ranks)",
            )
        engram = self.memory.engram
        if engram.layers and mp != "auto" and engram.head_dim % mp:
            raise ConfigError("memory.engram.head_dim", engram.head_dim,
                              f"a multiple of parallel.memory_parallel={mp} (Engram's tables are split by columns "
                              "over the memory-parallel ranks)")
        if engram.layers and engram.tables_in == "host":
            if not (self.memory.sparse_updates or mode_of(self).row_gradients):
                raise ConfigError("memory.engram.tables_in", "host", "device, or host with memory.sparse_updates="
                                  "true (host tables are updated by rows: only the rows a step read come back)")
            if mp not in (1, "auto"):
                raise ConfigError("memory.engram.tables_in", "host", f"device with parallel.memory_parallel={mp} "
                                  "(host tables are kept whole by one process), or host with memory_parallel 1")
        self.data.validate()
        if self.model.doc_mask and self.data.kind == "random":
            raise ConfigError("model.doc_mask", True, "false with data.kind=random (random tokens have no "
                              "documents); or a data kind with documents: " + ", ".join(
                                  k for k in DATA_KINDS if k != "random"))
        self.optim.validate()
        self.parallel.validate()
        self.eval.validate()
        self.logging.validate()
        self.checkpoint.validate()
        self.profile.validate(self.steps)
        self.finetune.validate()
        mode_of(self).validate(self)  # what the fine-tune mode needs of the model (memlm.finetune.modes)
        if self.init_from and self.resume not in ("none", "auto"):
            # resume=auto + init_from: a checkpoint in dump_dir wins, init_from starts a run that has
            # none (a requeued or restarted fine-tune continues instead of starting over).
            raise ConfigError("resume", self.resume, f"none or auto with init_from={self.init_from} (a checkpoint "
                              "named by resume restores the weights itself; leave init_from empty for it)")
        if self.init_from.startswith(HF_PREFIX) and not self.init_from[len(HF_PREFIX):].strip():
            raise ConfigError("init_from", self.init_from, "hf:<dir>, the folder of a Hugging Face Llama "
                              "checkpoint or of a memlm export")
        if self.steps < 0:
            raise ConfigError("steps", self.steps, "an integer >= 0")
        for key in ("global_batch_tokens", "val_every", "val_batches"):
            if getattr(self, key) < 0:
                raise ConfigError(key, getattr(self, key), "an integer >= 0")
        if self.max_nonfinite_steps < 1:
            raise ConfigError("max_nonfinite_steps", self.max_nonfinite_steps, "an integer >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", self.device, "one of: auto, cpu, cuda")
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
        if (unknown := unknown_key_error(overrides, Config, GROUPS)) is not None:
            raise unknown from None
        detail = f"{err} ({err.__cause__})" if err.__cause__ else str(err)
        detail = " ".join(detail.split())  # one line
        raise ConfigError("overrides", overrides, f"a valid Hydra override list; Hydra said: {detail}") from None
    # `+key=value` adds a key Hydra accepts and the typed config then drops: refuse it too.
    if (unknown := unknown_key_error(overrides, Config, GROUPS)) is not None:
        raise unknown
    OmegaConf.resolve(cfg)
    return cfg


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> Config:
    """Compose configs/ + overrides into a validated `Config`."""
    cfg = compose_dict(overrides, config_name)
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config)
    config.memory.split_sparse_budget(config.model.dim)  # derived sizes first, so validation checks them
    config.validate()
    # A finetune.* setting the mode would ignore: refused in what the user composes, not in a
    # saved config (a finished run's record stays readable).
    mode_of(config).refuse_ignored(config.finetune)
    # What init_from points at (a checkpoint, an export, a Llama) is read by
    # memlm.train.preflight.check_init_from, before a run starts: composing
    # reads no files, so a saved run's config stays loadable after that folder is gone.
    return config


def _missing_option_error(overrides: list[str], err: MissingConfigException) -> ConfigError:
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in GROUPS and value and value not in group_options(key):
            return ConfigError(key, value, f"one of the presets in configs/{key}/: {', '.join(group_options(key))}")
    return ConfigError("overrides", overrides, str(err))


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def from_yaml(text: str) -> Config:
    """A Config saved with `to_yaml` (e.g. in a checkpoint), validated again."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text))
    config = OmegaConf.to_object(merged)
    assert isinstance(config, Config)
    config.validate()
    return config
