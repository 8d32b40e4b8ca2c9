"""What each fine-tune mode means, one object per mode (`finetune.mode`; docs/finetuning.md).

    mode = mode_of(cfg)                        # MODES[cfg.finetune.mode]
    mode.validate(cfg)                         # what the mode needs of the model (Config.validate)
    mode.check_inputs(cfg, init)               # the files it reads (sparse: the background)
    mode.refuse_ignored(cfg.finetune)          # a finetune.* setting it would ignore (compose)
    mode.adapt(model, cfg)                     # the architecture its runs hold (lora: the adapters)
    mode.freeze(model)                         # before sharding: what does not train gets no gradient
    hook = mode.step_hook(model, cfg, distributed, init)  # step_start(step); backward; after_backward()
    mode.row_gradients                         # its gradients are row-sparse: the optimizer updates rows
    mode.fresh_on_init(key)                    # init_from: tensors a run of this mode starts fresh
    state = mode.export_state(state, cfg)      # what an export folds in (lora: merged adapters)
    mode.lr(cfg), mode.describe(cfg)           # its learning rate, its setting in words (study reports)
    mode.lr_settings(cfg)                      # {key: value} of the learning rates it trains with

- full: every parameter (pretraining, or a full fine-tune).
- memory: only the sparse tables (memlm.memory.tables: value pools, PEER's
  experts); every other parameter is frozen before the model is sharded: it
  gets no gradient, no optimizer state, and stays bitwise unchanged.
- sparse: as memory, and each step keeps the gradient of only the `top_t`
  rows of each product-key table that its batch reads most above the
  background's reads (memlm.finetune.selection); the row-wise optimizers then
  touch those rows alone, moments and weight decay included.
- lora: low-rank adapters on the projections (model/lora.py), every base
  weight frozen; an export merges them into their weights.

The trainer, the loader of runs (memlm.run.load) and the exporter ask these
objects; nothing else branches on a mode's name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from memlm.errors import ConfigError
from memlm.finetune.background import FILE, usage_metadata
from memlm.finetune.config import FinetuneConfig
from memlm.finetune.selection import SlotSelection
from memlm.memory.slot_selection import BY_BATCHES
from memlm.memory.tables import sparse_tables
from memlm.model.family import families, memory_family
from memlm.model.ffn import table_kinds
from memlm.model.lora import add_lora, is_lora_key, merge_lora_state

Config = Any  # memlm.config.run.Config, which imports this module


class NoStepHook:
    """The step hook of a mode that changes nothing between backward and optimizer step."""

    def describe(self) -> str | None:
        """A line for the run's start (what the hook reads), or None."""
        return None

    def step_start(self, step: int) -> None:
        pass

    def after_backward(self) -> None:
        pass


class Mode:
    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()  # the finetune.* keys (besides mode) this mode reads
    row_gradients: ClassVar[bool] = False

    def validate(self, cfg: Config) -> None:
        """What the mode needs of the model and the other settings (ConfigError naming the key)."""

    def refuse_ignored(self, ft: FinetuneConfig) -> None:
        """A finetune.* key set away from its default that this mode would ignore: one line naming
        the key, the value and the modes that read it."""
        defaults = FinetuneConfig()
        for f in dataclasses.fields(FinetuneConfig):
            key = f.name
            if key == "mode" or key in self.reads or getattr(ft, key) == getattr(defaults, key):
                continue
            readers = " or ".join(name for name, mode in MODES.items() if key in mode.reads)
            raise ConfigError(f"finetune.{key}", getattr(ft, key), f"left at its default "
                              f"({getattr(defaults, key)!r}) with finetune.mode={self.name}, which ignores it "
                              f"(finetune.mode={readers} reads it)")

    def check_inputs(self, cfg: Config, init: Any) -> None:
        """The files the mode reads exist (the run's preflight: memlm.train.preflight). `init`: what
        cfg.init_from names (memlm.run.source.ModelSource; None without init_from)."""

    def adapt(self, model: nn.Module, cfg: Config) -> None:
        """Add what the mode adds to the architecture (a run's checkpoints hold it too)."""

    def trains(self, key: str, param: nn.Parameter, tables: set[int]) -> bool:
        return True

    def freeze(self, model: nn.Module) -> None:
        """Every parameter the mode does not train stops requiring a gradient (before sharding:
        frozen parameters get no gradient and no optimizer state)."""
        tables = {id(p) for p in sparse_tables(model)}
        for key, p in model.named_parameters():
            if not self.trains(key, p, tables):
                p.requires_grad_(False)

    def step_hook(self, model: nn.Module, cfg: Config, distributed: bool, init: Any):
        return NoStepHook()

    def fresh_on_init(self, key: str) -> bool:
        """init_from loads every tensor but these (they start as initialized)."""
        return False

    def export_state(self, state: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
        return state

    def lr(self, cfg: Config) -> float:
        """The base learning rate of what the mode trains."""
        return cfg.optim.lr

    def lr_settings(self, cfg: Config) -> dict[str, float]:
        """{key: value} of every learning rate the mode trains with (a non-finite stop names them):
        optim.lr, and memory.value_lr for a model with value tables (they keep their own)."""
        settings = {"optim.lr": cfg.optim.lr}
        if cfg.memory.kind in table_kinds() or cfg.memory.engram.layers:
            settings["memory.value_lr"] = cfg.memory.value_lr
        return settings

    def describe(self, cfg: Config) -> str:
        return f"AdamW lr {self.lr(cfg):g}"


class Full(Mode):
    name = "full"

    def describe(self, cfg: Config) -> str:
        # The value tables keep their own rate (memory.value_lr), which optim.lr does not lower: two full
        # settings at one optim.lr differ by it, so the setting names it.
        values = self.lr_settings(cfg).get("memory.value_lr")
        return super().describe(cfg) + ("" if values is None else f", values lr {values:g}")


class Memory(Mode):
    name = "memory"
    reads = ("optimizer",)
    kinds_note = "trains only the value tables"

    def validate(self, cfg: Config) -> None:
        kinds = table_kinds()
        if cfg.memory.kind == "none" and cfg.memory.engram.layers:
            return  # Engram's tables are the tables it trains
        if cfg.memory.kind == "none":
            raise ConfigError("finetune.mode", self.name, "full for a model without memory layers (memory.kind="
                              f"none): mode={self.name} trains only the memory's value tables")
        if cfg.memory.kind not in kinds:
            raise ConfigError("finetune.mode", self.name, f"full or lora with memory.kind={cfg.memory.kind}, which "
                              f"has no value tables: mode={self.name} {self.kinds_note} of memory.kind="
                              f"{', '.join(kinds)}")

    def trains(self, key: str, param: nn.Parameter, tables: set[int]) -> bool:
        return id(param) in tables

    def lr(self, cfg: Config) -> float:
        return cfg.memory.value_lr

    def lr_settings(self, cfg: Config) -> dict[str, float]:
        return {"memory.value_lr": cfg.memory.value_lr}

    def describe(self, cfg: Config) -> str:
        return f"{cfg.finetune.optimizer} lr {self.lr(cfg):g}"


class Sparse(Memory):
    name = "sparse"
    reads = ("optimizer", "top_t", "ranking", "background")
    row_gradients = True
    kinds_note = "selects the rows of memory layers that count their reads per row"

    def validate(self, cfg: Config) -> None:
        fam, engram = memory_family(cfg.memory), cfg.memory.engram
        # Every table it trains must count its reads per row: a family's (sparse_rows) or Engram's.
        counted = fam is not None and fam.sparse_rows
        uncounted = fam is not None and fam.holds_tables and not fam.sparse_rows
        if uncounted or not (counted or engram.layers):
            rows = [f.kind for f in families() if f.sparse_rows]
            raise ConfigError("finetune.mode", self.name, f"full, lora or memory with memory.kind="
                              f"{cfg.memory.kind}: mode={self.name} {self.kinds_note} (memory.kind="
                              f"{' or '.join(rows)}, or Engram layers with no other tables)")
        sizes = {}
        if counted:
            sizes[f"memory.kind={cfg.memory.kind}, memory.n_keys={cfg.memory.n_keys}"] = \
                fam.value_pools(cfg.memory, cfg.model).rows
        if engram.layers:
            sizes["Engram's, memory.engram.rows_per_head"] = engram.table_rows(cfg.model.vocab_size)
        where, slots = min(sizes.items(), key=lambda item: item[1])
        if cfg.finetune.top_t > slots:
            raise ConfigError("finetune.top_t", cfg.finetune.top_t, f"at most the table's {slots:,} rows ({where})")

    def background_path(self, cfg: Config, init: Any) -> Path:
        """finetune.background, else slot_usage.safetensors in the init_from checkpoint folder."""
        if cfg.finetune.background:
            return Path(cfg.finetune.background)
        if init is None or init.kind != "checkpoint":
            raise ConfigError("finetune.background", cfg.finetune.background,
                              "the path of a slot-usage file (python -m memlm.train.slot_usage <the model> "
                              f"--out <file>); init_from={cfg.init_from or '(empty)'} is no checkpoint folder "
                              "to find one in")
        return init.directory / FILE

    def check_inputs(self, cfg: Config, init: Any) -> None:
        """The background file exists (its layers are checked against the model when it loads)."""
        path = self.background_path(cfg, init)
        if not path.is_file():
            raise ConfigError("finetune.background", str(path), "a slot-usage file of the init_from model "
                              f"(write one: python -m memlm.train.slot_usage {cfg.init_from or '<model>'}); "
                              "docs/finetuning.md")
        if cfg.finetune.ranking in BY_BATCHES and not usage_metadata(path).get("batches"):
            raise ConfigError("finetune.background", str(path), "a slot-usage file that counts the batches reading "
                              f"each slot (for finetune.ranking={cfg.finetune.ranking}; this one lacks its batch "
                              f"count): count it again with python -m memlm.train.slot_usage "
                              f"{cfg.init_from or '<model>'}")

    def step_hook(self, model: nn.Module, cfg: Config, distributed: bool, init: Any):
        return SlotSelection(model, cfg, self.background_path(cfg, init), distributed)

    def describe(self, cfg: Config) -> str:
        ranking = "" if cfg.finetune.ranking == FinetuneConfig().ranking else f" by {cfg.finetune.ranking}"
        return f"top_t {cfg.finetune.top_t:,}{ranking}, {super().describe(cfg)}"


class Lora(Mode):
    name = "lora"
    reads = ("lora_rank", "lora_alpha", "lora_targets")

    def adapt(self, model: nn.Module, cfg: Config) -> None:
        add_lora(model, cfg.finetune.lora_rank, cfg.finetune.lora_alpha, cfg.finetune.lora_targets)

    def trains(self, key: str, param: nn.Parameter, tables: set[int]) -> bool:
        return is_lora_key(key)

    def fresh_on_init(self, key: str) -> bool:
        return is_lora_key(key)

    def export_state(self, state: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
        return merge_lora_state(state, cfg.finetune.lora_alpha / cfg.finetune.lora_rank)

    def lr_settings(self, cfg: Config) -> dict[str, float]:
        return {"optim.lr": cfg.optim.lr}

    def describe(self, cfg: Config) -> str:
        return f"rank {cfg.finetune.lora_rank}, {super().describe(cfg)}"


MODES: dict[str, Mode] = {m.name: m for m in (Full(), Memory(), Sparse(), Lora())}


def mode_of(cfg: Config) -> Mode:
    """The object of `finetune.mode` (ConfigError naming the modes there are)."""
    if cfg.finetune.mode not in MODES:
        raise ConfigError("finetune.mode", cfg.finetune.mode, f"one of: {', '.join(MODES)}")
    return MODES[cfg.finetune.mode]
