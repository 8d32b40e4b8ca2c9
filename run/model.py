"""The model a run holds, built in one place for training, loading and slot usage.

    model = build_run_model(cfg)                                    # one process, on CPU: a loader's
    model = build_run_model(cfg, env, meshes, wrap=parallelize)     # the trainer's (memlm.train.trainer)

The steps: the architecture the config names (init=full: built and
initialized on CPU, identical on every rank; init=sharded: on the meta
device) -> what the fine-tune mode adds (lora's adapters) and freezes ->
the value tables column-sharded over the memory-parallel group -> `wrap`,
what training adds before the weights are materialized (activation
checkpointing, compile, FSDP2: memlm.distributed.parallelize) -> the weights
on the device, initialized -> the value tables drawn from the seed alone -> Engram's tables moved to host memory
(memory.engram.tables_in=host, memlm.memory.host_tables). A loader then
overwrites every weight with a checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memlm.config.run import Config
from memlm.distributed import memory_hooks
from memlm.distributed.env import DistEnv, Meshes, seed_everything, shard_index
from memlm.errors import ConfigError
from memlm.finetune.modes import mode_of
from memlm.model import Transformer
from memlm.model.lora import reset_lora


def engram_token_map(cfg: Config) -> torch.Tensor | None:
    """The Engram layers' canonical ids (memory.engram.token_map=tokenizer: from the run's tokenizer
    pieces, memlm.memory.engram_vocab), or None: no Engram layers, the identity map asked for, or a run
    without a tokenizer (data.kind=random)."""
    if not cfg.memory.engram.layers or cfg.memory.engram.token_map == "identity":
        return None
    from memlm.run.load import run_tokenizer_path  # run.load builds its models with this module

    path = run_tokenizer_path(cfg)
    if path is None:
        return None
    from memlm.data.tokenizer import Tokenizer
    from memlm.memory.engram_vocab import canonical_map

    sp = Tokenizer(path).sp
    token_map = canonical_map([sp.id_to_piece(i) for i in range(sp.vocab_size())])
    extra = cfg.model.vocab_size - len(token_map)
    if extra < 0:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size, f"at least the tokenizer's {len(token_map):,} "
                          f"pieces ({path}): the Engram layers map every token id")
    # A model vocabulary larger than the tokenizer's (padded, or a tokenizer that took fewer pieces than
    # asked): ids no text encodes to, each its own canonical id after the pieces'.
    return torch.cat([token_map, int(token_map.max()) + 1 + torch.arange(extra)])


def build_run_model(cfg: Config, env: DistEnv | None = None, meshes: Meshes | None = None,
                    wrap: Callable[[Transformer], None] | None = None) -> Transformer:
    """The run's model on `env` (default: this one process on CPU) and `meshes` (default: none)."""
    env = env or DistEnv.one_process("cpu")
    meshes = meshes or Meshes(None, None)
    seed_everything(cfg.seed)
    token_map = engram_token_map(cfg)
    if cfg.parallel.init == "full":
        model = Transformer(cfg.model, cfg.memory, token_map)  # on CPU, identical on every rank
        model.init_weights()
    else:
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.memory, token_map)
    mode = mode_of(cfg)
    mode.adapt(model, cfg)  # lora's adapters
    mode.freeze(model)  # before sharding: frozen parameters get no gradient or state
    memory_hooks.shard_memory_values(model, meshes, env)
    if wrap is not None:
        wrap(model)
    if cfg.parallel.init == "full":
        model.to(env.device)
    else:
        model.to_empty(device=env.device)
        # One stream per shard, shared by its replicas (hybrid: across nodes); on
        # CUDA, DTensor's RNG tracker does the same from rank 0's state.
        seed_everything(cfg.seed + shard_index(meshes, env))
        model.init_weights()
        reset_lora(model)
    # Value tables from the seed alone: replicas agree, init=full == init=sharded.
    memory_hooks.init_value_tables(model, cfg.seed)
    if cfg.memory.engram.layers and cfg.memory.engram.tables_in == "host":
        keep_engram_tables_on_host(model, env)
    return model


def keep_engram_tables_on_host(model: Transformer, env: DistEnv) -> None:
    """Every Engram layer's table in host memory, read through memlm.memory.host_tables (drawn on the
    device first, so a host table starts as a device table does on the same machine)."""
    from memlm.memory.host_tables import keep_on_host

    if env.world_size > 1:
        raise ConfigError("memory.engram.tables_in", "host", f"device on {env.world_size} ranks: a host table is "
                          "trained by one process (its row gradients are not reduced over ranks)")
    for block in model.layers:
        if block.engram is not None:
            keep_on_host(block.engram.tables)


def host_row_staging(model: Transformer) -> list:
    """The training loop's component that stages each micro-batch's rows for the Engram tables kept in host
    memory (memlm.memory.host_tables.StageRows), or none when no table is read through HostRowsReader."""
    from memlm.memory.host_tables import HostRowsReader, StageRows

    engrams = [b.engram for b in model.layers if b.engram is not None and isinstance(b.engram.tables.reader,
                                                                                        HostRowsReader)]
    return [StageRows(engrams)] if engrams else []
