"""The value table of a memory: one (N, v_dim) parameter, possibly shared.

A `ValuePool` is an ordinary module. Memory+ shares one pool between all the
memory layers of a model (docs/memory.md, "The math, as implemented"): the pool object is
passed to each layer, and whoever builds the layers registers it once as a
submodule of a common parent (memlm's Transformer keeps it in
`model.shared`). A layer that is given a pool keeps only a plain reference to
it, so parameters() and state_dict() hold the table exactly once. There is no
class-level or module-level registry.

A training run initializes its tables with `seeded_normal_` (a function of
the seed alone, drawn tile by tile), so every copy and every column shard of
a table holds the same numbers whatever the number of ranks:

    seeded_normal_(shard, seed, pool.init_std, col_offset=r * shard.shape[1], full_cols=pool.v_dim)
"""

from __future__ import annotations

import torch
from torch import nn

from memlm.memory.config import VALUE_DTYPE_NAMES
from memlm.memory.fast.exact import full_precision
from memlm.memory.fast.hugepages import advise_huge_pages
from memlm.memory.fast.launches import NO_LAUNCHES, ReadLaunches
from memlm.memory.fast.ops import embedding_bag

# memory.value_dtype -> the table's storage dtype. bf16 halves the table, its
# gradient and the bytes each read moves; the optimizer keeps float32 moments
# for it (memlm.memory.sparse_adamw). See docs/memory.md, "Value precision".
VALUE_DTYPES = dict(zip(VALUE_DTYPE_NAMES, (torch.float32, torch.bfloat16), strict=True))


@torch.compiler.disable  # a reader (memory parallelism) runs collectives and DTensor code: eager
def _read_through(reader, pool, indices, weights, sparse, kernel, launches):
    return reader(pool, indices, weights, sparse, kernel, launches)


class ValuePool(nn.Module):
    # Read by Transformer.num_params(): the table counts as memory parameters.
    param_category = "memory"

    def __init__(self, n_slots: int, v_dim: int, init_scale: float = 1.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        if n_slots < 1 or v_dim < 1:
            raise ValueError(f"a value pool needs n_slots >= 1 and v_dim >= 1, got {n_slots}, {v_dim}")
        if not init_scale >= 0:  # also rejects NaN
            raise ValueError(f"a value pool needs init_scale >= 0, got {init_scale}")
        self.n_slots = n_slots
        self.v_dim = v_dim
        # Multiplies the published init std (memory.value_init_scale): 1 is
        # the paper's init, 0 starts every value at zero.
        self.init_scale = init_scale
        if dtype not in VALUE_DTYPES.values():
            raise ValueError(f"a value pool stores {list(VALUE_DTYPES.values())}, got {dtype}")
        self.weight = nn.Parameter(torch.empty(n_slots, v_dim, dtype=dtype))
        # Rows each token reads from this pool, summed over the layers that
        # read it (each adds heads * knn when it is built): what one token
        # "uses" for the active-parameter count.
        self.reads_per_token = 0
        self.layers = 0  # the layers that read it (the planner's reads per step)
        # How the table is read: None -> a local read through memory.fast.ops.
        # Memory parallelism (distributed/memory_parallel.py) installs a column-parallel
        # reader here, called as reader(pool, indices, weights, sparse, kernel, launches).
        self.reader = None
        self.init_weights()  # like torch.nn layers; init_weights() again after to_empty()

    def add_reader(self, reads_per_token: int) -> None:
        """Called by each layer that reads this pool (at construction)."""
        self.reads_per_token += reads_per_token
        self.layers += 1

    def read(
        self, indices: torch.Tensor, weights: torch.Tensor, sparse: bool = False, kernel: str = "auto",
        launches: ReadLaunches = NO_LAUNCHES,
    ) -> torch.Tensor:
        """indices, weights (B, K) -> (B, v_dim) in the table's dtype:
        sum_k weights[b, k] * table[indices[b, k]].

        The local read is a custom op (memory/fast/ops.py): torch.compile traces
        it without a graph break; an installed reader runs eagerly. Autocast
        is off: the read's dtype is the table's (memory.value_dtype)."""
        with full_precision(indices.device):
            if self.reader is not None:
                return _read_through(self.reader, self, indices, weights, sparse, kernel, launches)
            return embedding_bag(self.weight, indices, weights, sparse=sparse, kernel=kernel,
                                 grad_into=None if sparse else self.gradient_buffer(), launches=launches)

    def gradient_buffer(self) -> torch.Tensor | None:
        """The table's gradient buffer, where every read's backward adds its
        rows, or None (then a read hands autograd its gradient, and autograd
        sums the reads'). A buffer is the table's own dense `.grad`, held
        between steps: the optimizers of memlm.memory (`keep_table_gradients`)
        zero it in place instead of dropping it, so the reads of a step, of all
        the layers sharing this pool and of every micro-batch, accumulate into
        one tensor and no dense per-read gradient is ever made."""
        w = self.weight
        g = w.grad
        if g is None or not (torch.is_grad_enabled() and w.requires_grad):
            return None
        if g.is_sparse or g.dtype != w.dtype or g.shape != w.shape:
            return None
        return g

    @property
    def init_std(self) -> float:
        return self.init_scale * self.v_dim**-0.5

    @torch.no_grad()
    def init_weights(self) -> None:
        # Before the first write (a fresh table is untouched until here): a
        # large CPU table read at random rows is ~2x faster on huge pages.
        advise_huge_pages(self.weight)
        # Values ~ N(0, v_dim**-0.5) (the published init, at init_scale 1): a
        # bag of k rows with softmax weights then has entries of at most that scale.
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def inactive_params(self) -> int:
        """Table entries one token does not read (at most `reads_per_token` rows are read)."""
        active_rows = min(self.n_slots, self.reads_per_token)
        return (self.n_slots - active_rows) * self.v_dim

    def extra_repr(self) -> str:
        return (f"n_slots={self.n_slots}, v_dim={self.v_dim}, init_scale={self.init_scale}, "
                f"dtype={self.weight.dtype}")


# Tiles of seeded_normal_: 16K rows x 128 columns (8 MB of float32). A shard
# whose columns start and end on tile edges draws only its own tiles.
TILE_ROWS, TILE_COLS = 1 << 14, 128
_MASK64 = (1 << 64) - 1


def tile_seed(*parts: int) -> int:
    """A 63-bit generator seed mixed from integers (splitmix64 steps): nearby
    inputs (seed 0 tile 1, seed 1 tile 0) give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for x in parts:
        h = ((h ^ (x & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h >> 1


@torch.no_grad()
def seeded_normal_(out: torch.Tensor, seed: int, std: float, col_offset: int = 0,
                   full_cols: int | None = None) -> torch.Tensor:
    """Fill `out` (rows, c) with columns [col_offset, col_offset + c) of a
    (rows, full_cols) N(0, std) table that depends on `seed` only.

    The full table is cut into TILE_ROWS x TILE_COLS tiles, each drawn from
    its own generator seeded by (seed, tile row, tile column) in float32 on
    `out`'s device. A column shard draws the tiles that overlap its columns
    and keeps its part, so the shards of any split, and every replica of a
    shard, hold exactly the numbers of the unsharded table (no rank ever
    holds more than one tile beyond its shard)."""
    rows, cols = out.shape
    full_cols = cols if full_cols is None else full_cols
    if col_offset < 0 or col_offset + cols > full_cols:
        raise ValueError(f"columns [{col_offset}, {col_offset + cols}) do not lie in a table of {full_cols} columns")
    if cols == 0:
        return out
    gen = torch.Generator(device=out.device)
    first, last = col_offset // TILE_COLS, (col_offset + cols - 1) // TILE_COLS
    for r0 in range(0, rows, TILE_ROWS):
        r1 = min(rows, r0 + TILE_ROWS)
        for j in range(first, last + 1):
            c0, c1 = j * TILE_COLS, min(full_cols, (j + 1) * TILE_COLS)
            gen.manual_seed(tile_seed(seed, r0 // TILE_ROWS, j))
            tile = torch.empty(r1 - r0, c1 - c0, device=out.device).normal_(0.0, std, generator=gen)
            lo, hi = max(c0, col_offset), min(c1, col_offset + cols)
            out[r0:r1, lo - col_offset:hi - col_offset].copy_(tile[:, lo - c0:hi - c0])
    return out
