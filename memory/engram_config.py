"""Typed configuration of the model's Engram layers: `memory.engram`, beside any memory kind.

Engram (memory/engram.py) is not a feed-forward kind: it adds to the residual
stream before a block's attention, so it combines with every `memory.kind`,
none included (configs/memory/engram.yaml places it alone):

    python -m memlm.train memory=engram                          # Engram at the preset's blocks
    python -m memlm.train memory=memplus memory.engram.layers=[0]   # Engram early, Memory+ FFNs as before

Its tables are sparse tables (memlm.memory.tables): they train with the value
group's settings, memory.value_lr, value_weight_decay and value_grad_clip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from memlm.errors import ConfigError

# memory.engram.token_map: where the canonical ids come from (memory/engram_vocab.py).
TOKEN_MAPS = ("tokenizer", "identity")
# memory.engram.tables_in: where the tables live in training (memory/host_tables.py for host).
TABLES_IN = ("device", "host")
MAX_SEED = 2**64


def engram_size_problem(dim: int, max_order: int, heads: int, head_dim: int, rows_per_head: int | Sequence[int],
                        kernel_size: int, dilation: int, seed: int, layer: int) -> tuple[str, object, str] | None:
    """The first invalid size of an Engram layer as (key, value, what is valid), or None.
    `rows_per_head`: one size for every order, or one per order 2..max_order."""
    if type(max_order) is not int or not 2 <= max_order <= 8:
        return "max_order", max_order, "an integer in [2, 8] (n-gram orders 2..max_order)"
    for key, value, low in (("dim", dim, 1), ("heads", heads, 1), ("head_dim", head_dim, 1),
                            ("kernel_size", kernel_size, 1), ("dilation", dilation, 1), ("layer", layer, 0)):
        if type(value) is not int or value < low:
            return key, value, f"an integer >= {low}"
    one_per_order = isinstance(rows_per_head, (list, tuple)) and len(rows_per_head) == max_order - 1
    sizes = [rows_per_head] if type(rows_per_head) is int else rows_per_head if one_per_order else [None]
    if any(type(r) is not int or r < 2 for r in sizes):
        return "rows_per_head", rows_per_head, \
            f"an integer >= 2 (every order), or one per n-gram order 2..{max_order} ({max_order - 1} of them)"
    if type(seed) is not int or not 0 <= seed < MAX_SEED:
        return "seed", seed, "an integer in [0, 2**64)"
    return None


@dataclass
class EngramConfig:
    # Blocks that get an Engram layer before their attention; [] -> none.
    layers: list[int] = field(default_factory=list)
    max_order: int = 3  # n-gram orders 2..max_order
    heads: int = 8  # hash heads per order
    head_dim: int = 64
    # Rows each head's table asks for (the next unused prime at or above it); 0 -> 5 x model.vocab_size.
    # The sizes follow from the config alone, so a checkpoint's shapes never depend on a tokenizer file.
    rows_per_head: int = 0
    kernel_size: int = 4
    dilation: int = 0  # 0 -> max_order
    hash_seed: int = 0  # the multipliers are a function of (hash_seed, layer) alone
    # tokenizer: canonical ids from the run's tokenizer pieces (NFKC, lowercase, accents stripped,
    # whitespace collapsed); a run without a tokenizer (data.kind=random) keeps the identity map.
    # identity: every token id is its own canonical id.
    token_map: str = "tokenizer"
    # One sparse parameter budget split between Engram's tables and the memory kind's value table
    # (memory.kind memory or memplus: n_keys**2 x v_dim; none: share 1). 0 -> off: each sized by its
    # own keys. With a budget, `compose` derives rows_per_head and memory.n_keys from it
    # (MemoryConfig.split_sparse_budget); the run's config.yaml records what they came to.
    budget: int = 0
    share: float = 0.0  # Engram's share of the budget, in (0, 1]
    # device: the tables sit with the model. host: in host memory, each read's rows copied to the device and
    # their row gradients back (memlm.memory.host_tables); needs row gradients (memory.sparse_updates=true)
    # and one process. The planner counts the bytes each step moves between them.
    tables_in: str = "device"

    def n_heads(self) -> int:
        """H: the hash heads of one layer, over every order."""
        return (self.max_order - 1) * self.heads

    def budget_rows_per_head(self) -> int:
        """The rows per head that give Engram's tables `share` of `budget` (every Engram layer counted)."""
        per_row = self.n_heads() * self.head_dim * max(1, len(self.layers))
        return max(2, round(self.share * self.budget / per_row))

    def resolved_rows_per_head(self, vocab_size: int) -> int:
        return self.rows_per_head or 5 * vocab_size

    def table_rows(self, vocab_size: int) -> int:
        """Rows of one layer's table: every head's prime, by order (memlm.memory.engram_hash.head_primes)."""
        from memlm.memory.engram_hash import head_primes

        primes = head_primes([self.resolved_rows_per_head(vocab_size)] * (self.max_order - 1), self.heads)
        return sum(p for order in primes for p in order)

    def resolved_dilation(self) -> int:
        return self.dilation or self.max_order

    def validate(self, n_layers: int, dim: int, vocab_size: int, prefix: str = "memory.engram") -> None:
        layers = list(self.layers)
        if any(type(i) is not int or not 0 <= i < n_layers for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"{prefix}.layers", layers,
                              f"distinct block indices in [0, {n_layers - 1}] (model.n_layers={n_layers}); [] for none")
        if self.token_map not in TOKEN_MAPS:
            raise ConfigError(f"{prefix}.token_map", self.token_map, f"one of: {', '.join(TOKEN_MAPS)}")
        if self.tables_in not in TABLES_IN:
            raise ConfigError(f"{prefix}.tables_in", self.tables_in, f"one of: {', '.join(TABLES_IN)}")
        for key in ("rows_per_head", "dilation"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "0 (the default) or a positive integer")
        if self.budget < 0:
            raise ConfigError(f"{prefix}.budget", self.budget, "0 (off) or the sparse parameters to split")
        if self.budget and not (0 < self.share <= 1 and layers):
            raise ConfigError(f"{prefix}.share", self.share, f"a number in (0, 1] with Engram layers "
                              f"({prefix}.layers) to give a share of {prefix}.budget={self.budget}")
        problem = engram_size_problem(dim, self.max_order, self.heads, self.head_dim,
                                      self.resolved_rows_per_head(vocab_size), self.kernel_size,
                                      self.resolved_dilation(), self.hash_seed, 0)
        if problem is not None:
            key, value, valid = problem
            key = {"seed": "hash_seed"}.get(key, key)
            raise ConfigError(f"{prefix}.{key}", value, valid)
