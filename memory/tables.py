"""Which tensors are the sparse tables: the one definition every user asks.

A module whose parameters form a large table, each row of which gets a
gradient only when a token reads it, declares `param_category = "memory"`:
the value pool of Memory / Memory+ layers (memory/values.py) and PEER's
expert table (model/peer.py). Everything that treats those tensors apart
from the dense weights asks this file:

    tables = sparse_tables(model)          # [Parameter]: value pools and PEER's expert tables
    dense, tables = split_params(model)    # once, at set-up: the optimizer's value group
                                           # (memory.value_lr, value_weight_decay), the clip
                                           # (memory.value_grad_clip), num_params()'s "memory"
    pools = value_pools(model)             # [ValuePool]: the tables read through a pool

`value_parameters` is sparse_tables under the name memlm.memory has long
exported (docs/memory.md, "Training hooks"), not a second definition.

Pools are the tables memory parallelism shards by columns
(memlm.distributed.memory_parallel), FSDP leaves alone, the value-gradient reduction
sums over replicas and the planner's value-table traffic counts. PEER's
expert tables are tables for the optimizer and the clip, but not pools: they
are sharded by rows with their block's FSDP unit, like any weight
(tests/unit/test_value_tables.py checks every user against this file).
"""

from __future__ import annotations

from torch import nn

CATEGORY = "memory"


def table_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that hold sparse tables, each once (a pool shared by several layers too)."""
    seen: dict[int, nn.Module] = {}
    for module in model.modules():
        if getattr(module, "param_category", None) == CATEGORY:
            seen.setdefault(id(module), module)
    return list(seen.values())


def sparse_tables(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of the table modules, each once, in module order."""
    seen: dict[int, nn.Parameter] = {}
    for module in table_modules(model):
        for p in module.parameters(recurse=False):
            seen.setdefault(id(p), p)
    return list(seen.values())


value_parameters = sparse_tables


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, tables): every parameter on one side. Take it once the model is
    wrapped (FSDP2 replaces the parameters when it shards them), before any
    forward: the sharded parameters are the ones that receive gradients."""
    tables = sparse_tables(model)
    ids = {id(p) for p in tables}
    return [p for p in model.parameters() if id(p) not in ids], tables


def value_pools(model: nn.Module) -> list[nn.Module]:
    """The table modules read through a pool's reader (memory/values.py)."""
    return [m for m in table_modules(model) if hasattr(m, "reader")]
