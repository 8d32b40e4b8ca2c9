"""Typed configuration of the memory layers (the `memory/` Hydra config group).

`kind` chooses what replaces the feed-forward network in the blocks listed by
`layers`; `none` keeps every block dense. The defaults are the published
Memory+ settings (see docs/memory.md, "The math, as implemented").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memlm.errors import ConfigError, check_number
from memlm.memory.engram_config import EngramConfig
from memlm.memory.fast.launches import ALGORITHMS as TRITON_ALGORITHMS
from memlm.memory.fast.launches import launch_problem
from memlm.memory.fast.ops import KERNELS

# memory.value_dtype choices; memlm.memory.values.VALUE_DTYPES maps them to torch dtypes.
VALUE_DTYPE_NAMES = ("fp32", "bf16")
# memory.kind values whose layers read value tables through a product-key
# lookup (memory/layers.py: Memory, MemoryPlus; model/memory_ffn.py builds them).
PRODUCT_KEY_KINDS = ("memory", "memplus")
# The choice lists of the memory settings: memory.gate (MemoryPlus's output
# gate), memory.placement, and memory.kernel's KERNELS, imported above from
# memlm.memory.fast.ops, which dispatches them (memory/fast/ imports nothing from here).
GATES = ("none", "sigmoid", "swilu")
PLACEMENTS = ("replace", "parallel")


def lookup_size_problem(n_keys: int, heads: int, k_dim: int, **knns: int) -> tuple[str, int, str] | None:
    """The first invalid size of a product-key lookup (Memory, Memory+, PEER),
    as (key, value, what is valid), or None. `knns`: the top-k sizes by name
    (knn=..., eval_knn=...). The one range check: MemoryConfig.validate
    raises it as a ConfigError, layers built by hand as a ValueError (check_lookup_size)."""
    for key, value in (("n_keys", n_keys), ("heads", heads)):
        if value < 1:
            return key, value, "an integer >= 1"
    if k_dim < 2 or k_dim % 2:
        return "k_dim", k_dim, "a positive even integer (the query is split into two halves of k_dim/2)"
    for key, value in knns.items():
        if not 1 <= value <= n_keys:
            return key, value, f"an integer in [1, n_keys={n_keys}] (top-k of each sub-key half)"
    return None


def check_lookup_size(n_keys: int, heads: int, k_dim: int, **knns: int) -> None:
    """lookup_size_problem as a ValueError naming the argument, its value and what is valid."""
    problem = lookup_size_problem(n_keys, heads, k_dim, **knns)
    if problem is not None:
        key, value, valid = problem
        raise ValueError(f"{key}={value!r} is invalid: {valid}")


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    """A ValueError naming `key` and its value unless it is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{key}={value!r} is invalid: one of {', '.join(choices)}")


@dataclass
class MemoryConfig:
    # FFN kind placed in the memory blocks: none | memory | memplus (later: moe | peer).
    kind: str = "none"
    # Block indices that get a memory layer. Empty with `spread > 0` means
    # `spread` layers evenly through the depth (24 layers, spread 3 -> 4,12,20).
    layers: list[int] = field(default_factory=list)
    spread: int = 0
    n_keys: int = 1024
    heads: int = 4
    knn: int = 32
    eval_knn: int = 32
    k_dim: int = 512
    v_dim: int = 0  # 0 -> the model dim
    share_values: bool = True
    qk_norm: bool = False
    gate: str = "swilu"  # none | sigmoid | swilu
    # Biases on Memory+'s W1 and W2: out = W2(y * silu(W1 x + b1)) + b2. The official
    # code's projections have them (nn.Linear's default), the paper's equation has
    # none. Default off, as every measured run so far: none has measured the biases
    # yet (docs/memory.md, "Where memlm's defaults differ from the official code").
    # Off, a model has exactly the tensors it had before this switch.
    # memory.kind=memplus only; the biases start at zero.
    w_bias: bool = False
    placement: str = "replace"  # replace | parallel
    value_lr: float = 1e-3
    value_weight_decay: float = 0.0
    # Multiplies the published value init std v_dim**-0.5 (0 -> zero values).
    value_init_scale: float = 1.0
    value_grad_clip: float = 1.0
    # Storage dtype of the value table: fp32 | bf16. bf16 halves the table,
    # its gradient and every read's traffic; the optimizer still keeps float32
    # moments, but an update smaller than half a bf16 step (2**-9 of the
    # value) is rounded away. Trade-off: docs/memory.md, "Value precision".
    value_dtype: str = "fp32"
    # Dtype of the value gradients sent between memory-parallel replicas:
    # fp32 | bf16 (half the bytes; the sum is rounded to bf16).
    value_grad_reduce_dtype: str = "fp32"
    balance_loss_coef: float = 0.0
    sparse_updates: bool = False
    kernel: str = "auto"  # auto | triton | torch
    # The Triton read (memory/fast/launches.py), set for the process when the model is
    # built: its algorithm, and each pass's launch, [] = measured or the rule, else
    # [block_b, block_k, num_warps, num_stages, maxnreg (0: the compiler's), busiest_first (0/1)].
    triton_algorithm: str = "segments"
    triton_forward: list[int] = field(default_factory=list)
    triton_backward: list[int] = field(default_factory=list)
    # Optional knn schedule (memory/schedule.py): the training knn moves linearly
    # from knn_schedule_start to knn over the first knn_schedule_steps steps.
    # 0 -> no schedule (knn from the first step).
    knn_schedule_start: int = 0
    knn_schedule_steps: int = 0
    # moe / peer baselines (model/moe.py, model/peer.py). MoE also uses
    # balance_loss_coef as its load-balancing coefficient (its preset: 0.01);
    # PEER uses n_keys (n_keys**2 experts), heads, knn and k_dim.
    n_experts: int = 8
    top_k: int = 2
    expert_hidden_dim: int = 0  # 0 -> dense SwiGLU hidden size // top_k (compute-matched)
    # ultramem (memory/ultramem.py, model/ultramem_ffn.py): the Tucker core's rank, implicit
    # value expansion (grid addresses per table row), the rows and columns the approximate
    # search keeps (0: min(knn, n_keys)), the pre-value dim (0: dim / 16; v_dim 0: 3 dim / 16),
    # and the SwiGLU beside the memory as a fraction of the dense FFN's width (0: none).
    rank: int = 2
    expansion: int = 1
    candidates: int = 0
    pre_dim: int = 0
    ffn_fraction: float = 0.5
    # Engram layers before chosen blocks' attention, beside any kind (memory/engram_config.py).
    engram: EngramConfig = field(default_factory=EngramConfig)

    def split_sparse_budget(self, dim: int) -> None:
        """With memory.engram.budget: set engram.rows_per_head to its share and n_keys to the rest (the
        value table n_keys**2 x v_dim). Called once, by `compose`, before validation checks the split."""
        if self.engram.budget and self.engram.layers and 0 < self.engram.share <= 1:
            self.engram.rows_per_head = self.engram.budget_rows_per_head()
            if self.kind in PRODUCT_KEY_KINDS:
                rest = (1 - self.engram.share) * self.engram.budget / (self.v_dim or dim)
                self.n_keys = max(1, round(rest**0.5))

    def places_layers(self) -> bool:
        """Whether the section puts anything into the model: a memory kind's layers or Engram's."""
        return self.kind != "none" or bool(self.engram.layers)

    def resolved_layers(self, n_layers: int) -> list[int]:
        """The block indices that hold a memory layer in an `n_layers`-deep model."""
        if self.kind == "none":
            return []
        if self.layers:
            return sorted(self.layers)
        if self.spread > 0:
            # Evenly spaced, centred in equal segments: 24 layers, 3 -> 4, 12, 20.
            seg = n_layers / self.spread
            return sorted({int(seg * i + seg / 2) for i in range(self.spread)})
        return []

    def validate(self, n_layers: int, prefix: str = "memory") -> None:
        """Check values that do not depend on a particular layer implementation."""
        if self.w_bias and self.kind != "memplus":
            raise ConfigError(f"{prefix}.w_bias", self.w_bias,
                              f"false with {prefix}.kind={self.kind!r}: the biases are Memory+'s W1 and W2 "
                              "(memory.kind=memplus)")
        self._validate_sparse_budget(prefix)
        if self.kind == "none":
            if self.engram.layers:  # Engram's tables alone use the value group's settings
                self._validate_table_optimizer(prefix)
            return
        for idx in self.layers:
            if not 0 <= idx < n_layers:
                raise ConfigError(
                    f"{prefix}.layers", list(self.layers),
                    f"every index must lie in [0, {n_layers - 1}] (model.n_layers={n_layers})",
                )
        # Explicit layers take precedence: a preset's spread is then ignored.
        if not self.layers and not 0 <= self.spread <= n_layers:
            # Usually a memory preset's spread on a model shallower than the preset assumes.
            raise ConfigError(f"{prefix}.spread", self.spread,
                              f"an integer in [0, {n_layers}] (model.n_layers={n_layers}); it places "
                              f"{self.spread} memory layers through the depth (a memory preset's default, e.g. "
                              f"memory=memplus's), more than this model has: name the blocks with "
                              f"{prefix}.layers=[{n_layers // 2}], or set {prefix}.spread<={n_layers}")
        if not self.resolved_layers(n_layers):
            raise ConfigError(
                f"{prefix}.layers", list(self.layers),
                f"memory.kind={self.kind!r} needs at least one layer: set memory.layers or memory.spread",
            )
        for key, choices in (("placement", PLACEMENTS), ("gate", GATES), ("kernel", KERNELS),
                             ("triton_algorithm", TRITON_ALGORITHMS)):
            if getattr(self, key) not in choices:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), f"one of: {', '.join(choices)}")
        for key in ("triton_forward", "triton_backward"):
            problem = launch_problem(getattr(self, key))
            if problem:
                raise ConfigError(f"{prefix}.{key}", list(getattr(self, key)), problem)
        self._validate_table_optimizer(prefix)
        if self.kind in PRODUCT_KEY_KINDS:
            self._validate_product_key_memory(prefix)
        # The other families' keys are their own to check (memlm.model.family: Family.validate).

    def _validate_sparse_budget(self, prefix: str) -> None:
        """memory.engram.budget: a kind it can split with, and the sizes `split_sparse_budget` derived."""
        e = self.engram
        if not e.budget:
            return
        if (e.share < 1) != (self.kind in PRODUCT_KEY_KINDS) or (e.share == 1) != (self.kind == "none"):
            raise ConfigError(f"{prefix}.engram.share", e.share,
                              f"1 with {prefix}.kind=none, below 1 with a kind whose value table it splits "
                              f"({' or '.join(PRODUCT_KEY_KINDS)}); {prefix}.kind is {self.kind!r}")
        if e.layers and 0 < e.share <= 1 and e.rows_per_head != e.budget_rows_per_head():
            raise ConfigError(f"{prefix}.engram.rows_per_head", e.rows_per_head,
                              f"{e.budget_rows_per_head()}, derived from {prefix}.engram.budget={e.budget} and "
                              f"share={e.share} (leave it to the budget, or set budget=0)")

    def _validate_table_optimizer(self, prefix: str) -> None:
        """The sparse tables' own optimizer numbers, for every family and Engram (memlm.optim.build.param_groups)."""
        check_number(f"{prefix}.value_lr", self.value_lr)
        check_number(f"{prefix}.value_grad_clip", self.value_grad_clip, zero="no clipping")
        check_number(f"{prefix}.value_weight_decay", self.value_weight_decay, zero="no weight decay")

    def validate_lookup_size(self, prefix: str, **knns: int) -> None:
        """A product-key lookup of n_keys, heads, k_dim and these knns fits (memory/product_keys.py)."""
        problem = lookup_size_problem(self.n_keys, self.heads, self.k_dim, **knns)
        if problem is not None:
            key, value, valid = problem
            raise ConfigError(f"{prefix}.{key}", value, valid.replace("n_keys=", f"{prefix}.n_keys="))

    def _validate_product_key_memory(self, prefix: str) -> None:
        """Values of the product-key memory layers (memory/layers.py)."""
        self.validate_lookup_size(prefix, knn=self.knn, eval_knn=self.eval_knn)
        if self.v_dim < 0:
            raise ConfigError(f"{prefix}.v_dim", self.v_dim, "0 (= model.dim) or a positive integer")
        if self.value_dtype not in VALUE_DTYPE_NAMES:
            raise ConfigError(f"{prefix}.value_dtype", self.value_dtype, f"one of: {', '.join(VALUE_DTYPE_NAMES)}")
        if self.value_grad_reduce_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"{prefix}.value_grad_reduce_dtype", self.value_grad_reduce_dtype, "one of: fp32, bf16")
        for key in ("balance_loss_coef", "value_init_scale"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "a number >= 0")
        if not 0 <= self.knn_schedule_start <= self.n_keys:
            raise ConfigError(
                f"{prefix}.knn_schedule_start", self.knn_schedule_start,
                f"0 (no schedule) or an integer in [1, memory.n_keys={self.n_keys}]",
            )
        if self.knn_schedule_steps < 0 or (self.knn_schedule_start and not self.knn_schedule_steps):
            raise ConfigError(
                f"{prefix}.knn_schedule_steps", self.knn_schedule_steps,
                "an integer >= 0, and >= 1 when memory.knn_schedule_start is set",
            )
