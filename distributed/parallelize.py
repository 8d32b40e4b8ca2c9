"""Apply activation checkpointing, torch.compile and FSDP2 to a Transformer.

Model code has no distributed code: everything here wraps the model from
the outside (the torchtitan split). Memory value tables are excluded from
FSDP; `memlm.distributed.memory_parallel` (through `memlm.distributed.memory_hooks`) shards them by columns instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from memlm.distributed.config import ParallelConfig
from memlm.distributed.env import Meshes
from memlm.distributed.precision import compute_dtype
from memlm.memory.tables import table_modules, value_pools
from memlm.model import Transformer, family_of

# The policy of the product-key lookups (query projection + sub-keys): gathered
# and computing in float32, so that the top-k selects what the float32 model
# selects (a bf16 query and bf16 keys change the selected set of ~23% of the
# lookups at n_keys 1024, k_dim 512, knn 32; memlm.memory.product_keys). Their
# forward input (an FSDP block's bf16 activations) is cast to float32 too.
FULL_PRECISION = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def _is_memory_block(block: nn.Module) -> bool:
    return bool(table_modules(block)) or family_of(block.ffn_kind).reads_rows


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """none | full: recompute every block in backward | selective: every other
    block. Blocks with a memory layer only recompute their attention: the
    memory read is cheap to keep and expensive (and gather-heavy) to redo."""
    if mode == "none":
        return
    for i, block in enumerate(model.layers):
        if mode == "selective" and i % 2:
            continue
        if _is_memory_block(block):
            block.attention = checkpoint_wrapper(block.attention, preserve_rng_state=False)
        else:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer) -> None:
    """Compile each block in place (`Module.compile`): parameter names, and so
    checkpoints, stay the same with and without compilation."""
    for block in model.layers:
        block.compile()


def apply_fsdp(model: Transformer, meshes: Meshes, cfg: ParallelConfig, device: torch.device) -> None:
    """fully_shard every block, then the root; parameters all-gathered in the
    compute dtype (memlm.distributed.precision: bf16 with parallel.dtype=bf16, and
    by default on GPU), gradients reduced in fp32, fp32 shards. One process has
    no mesh and gets its bf16 from autocast instead (distributed/precision.py says
    why). Memory value pools are left out: they are column-sharded by
    memlm.distributed.memory_parallel (other sparse tables, such as PEER's experts, stay
    under FSDP). Modules that ask for it (`full_precision_params`: the
    product-key lookups) are units of their own inside their block, gathered
    in float32 (FULL_PRECISION)."""
    if meshes.fsdp is None:
        return
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype(cfg, device), reduce_dtype=torch.float32)
    ignored = {pool.weight for pool in value_pools(model)}
    placement = _shard_placement(meshes.fsdp.size())
    for block in model.layers:
        for module in [m for m in block.modules() if getattr(m, "full_precision_params", False)]:
            fully_shard(module, mesh=meshes.fsdp, mp_policy=FULL_PRECISION, shard_placement_fn=placement)
        fully_shard(block, mesh=meshes.fsdp, mp_policy=mp, ignored_params=ignored or None,
                    shard_placement_fn=placement)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=mp, ignored_params=ignored or None,
                reshard_after_forward=False, shard_placement_fn=placement)


def parallelize(model: Transformer, meshes: Meshes, cfg: ParallelConfig, device: torch.device) -> None:
    """What training adds to the run's model before its weights are materialized, in this
    order: activation checkpointing, compile, FSDP2 (memlm.run.model)."""
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    if cfg.compile:
        apply_compile(model)
    apply_fsdp(model, meshes, cfg, device)


def _shard_placement(ranks: int):
    """FSDP shards dim 0 and pads it to a multiple of the ranks. A parameter
    whose dim 0 is smaller than the group (product keys: (heads, 2, n_keys,
    k_dim / 2), 4 heads on 512 ranks) would be padded 128x, and every
    all-gather would move the padding: shard its largest dim instead."""
    def placement(param: nn.Parameter) -> Shard | None:
        if param.dim() < 2 or param.shape[0] >= ranks:
            return None  # FSDP's default, Shard(0)
        largest = max(range(param.dim()), key=lambda d: param.shape[d])
        # FSDP pads dim 0 only: another dim must divide evenly (a tiny tensor, such as
        # UltraMem's (heads, rank, rank) cores, keeps Shard(0) and its padding).
        return Shard(largest) if param.shape[largest] % ranks == 0 else None
    return placement


def reshard(model: nn.Module) -> None:
    """Free the unsharded parameters an inference forward left behind.

    The root keeps its parameters unsharded after forward (no backward follows
    under no_grad to reshard them); the optimizer and checkpointing expect the
    sharded ones registered."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
