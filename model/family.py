"""A memory family (an FFN kind) is one object: what it builds and what it needs from the house.

    @register_family
    class Dense(Family):
        kind, label = "dense", "Dense"
        llama_equivalent = True

        def build(self, ctx: FFNContext) -> nn.Module:
            return SwiGLU(ctx.args.dim, ctx.args.hidden_dim)

    family_of("memplus").holds_tables          # True: the house asks the object, never the name
    memory_family(cfg.memory)               # the run's memory family, None for memory.kind=none

The trainer, the optimizer builder, the planner, the fine-tune modes, the
exporter and the study reports ask a family; none of them compares its name
(tests/unit/test_families.py fails on a family name compared outside the
family's own files). A family declares:
- `build(ctx)`: the block's FFN module, (batch, seq, dim) -> (batch, seq, dim);
- `validate(memory, prefix)`: its keys of the memory section;
- `holds_tables`: its modules hold sparse tables (memlm.memory.tables): they
  get the value group's optimizer (memory.value_lr, value_weight_decay,
  value_grad_clip) and are all that finetune=memory trains;
- `reads_rows`: its tables are product-key value pools, read by rows: stored in
  memory.value_dtype with float32 moments, their blocks' attention alone
  recomputed under activation checkpointing;
- `sparse_rows`: its layers count their reads per table row (`usage`, `row_tables()`), so
  finetune=sparse selects the rows a step may change;
- `product_keys`: addressed by product keys (memory.n_keys**2 slots or experts);
- `value_pools(memory, args)`: the value pools (memlm.memory.values.ValuePool) its layers
  would build, from the config alone: (tables, rows, v_dim, rows a layer reads per token),
  or None (the trainer lays out memory parallelism before the model exists);
- `step_start(model, memory, step)`: before each optimizer step (`step` done so far);
- `llama_equivalent`: its weights map onto a Hugging Face Llama's (the export without remote code);
- `remote_code`: the modeling file an export ships (hf/remote/) builds it, so `transformers` loads
  its exports with `trust_remote_code=True`; an export of a family without it loads with memlm only;
- `label`: its name in reports.
Where it shards, what its health metrics are and what its export holds
follow from its modules and these flags (docs/architecture.md, "A memory family").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from torch import nn

from memlm.errors import ConfigError

if TYPE_CHECKING:
    from memlm.model.ffn import FFNContext


class PoolShape(NamedTuple):
    """What a family's value pools are, from the config: their count, rows and width, and the rows
    one layer reads per token."""

    tables: int
    rows: int
    v_dim: int
    reads_per_token: int


class Family:
    kind: ClassVar[str]
    label: ClassVar[str]
    holds_tables: ClassVar[bool] = False
    reads_rows: ClassVar[bool] = False
    sparse_rows: ClassVar[bool] = False
    product_keys: ClassVar[bool] = False
    llama_equivalent: ClassVar[bool] = False
    remote_code: ClassVar[bool] = False

    def build(self, ctx: FFNContext) -> nn.Module:
        raise NotImplementedError

    def validate(self, memory: Any, prefix: str = "memory") -> None:
        """Its keys of the memory section (ConfigError naming the key, the value and what is valid)."""

    def value_pools(self, memory: Any, args: Any) -> PoolShape | None:
        """The value pools its layers build (a pool shared by all of them: tables 1), or None."""
        return None

    def step_start(self, model: nn.Module, memory: Any, step: int) -> None:
        """Before each optimizer step; `step`: optimizer steps done so far."""


# Filled at import time by `register_family`; read-only afterwards.
_FAMILIES: dict[str, Family] = {}


def register_family(cls: type[Family]) -> type[Family]:
    if cls.kind in _FAMILIES and type(_FAMILIES[cls.kind]) is not cls:
        raise ValueError(f"FFN kind {cls.kind!r} is already registered")
    _FAMILIES[cls.kind] = cls()
    return cls


def family_of(kind: str) -> Family:
    """The family of FFN kind `kind` (ConfigError naming the kinds there are)."""
    if kind not in _FAMILIES:
        raise ConfigError("ffn kind", kind, f"one of: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[kind]


def families() -> list[Family]:
    return [_FAMILIES[k] for k in sorted(_FAMILIES)]


def memory_family(memory: Any) -> Family | None:
    """The family a memory section places (memory.kind), None for none (or no section)."""
    if memory is None or memory.kind == "none":
        return None
    return family_of(memory.kind)
