"""The model a run holds, built in one place for training, loading and slot usage.

    model = build_run_model(cfg)                                    # one process, on CPU: a loader's
    model = build_run_model(cfg, env, meshes, wrap=parallelize)     # the trainer's (memlm.train.trainer)

The steps: the architecture the config names (init=full: built and
initialized on CPU, identical on every rank; init=sharded: on the meta
device) -> what the fine-tune mode adds (lora's adapters) and freezes ->
the value tables column-sharded over the memory-parallel group -> `wrap`,
what training adds before the weights are materialized (activation
checkpointing, compile, FSDP2: memlm.distributed.parallelize) -> the weights
on the device, initialized -> the value tables drawn from the seed alone.
A loader then overwrites every weight with a checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memlm.config.run import Config
from memlm.distributed import memory_hooks
from memlm.distributed.env import DistEnv, Meshes, seed_everything, shard_index
from memlm.finetune.modes import mode_of
from memlm.model import Transformer
from memlm.model.lora import reset_lora


def build_run_model(cfg: Config, env: DistEnv | None = None, meshes: Meshes | None = None,
                    wrap: Callable[[Transformer], None] | None = None) -> Transformer:
    """The run's model on `env` (default: this one process on CPU) and `meshes` (default: none)."""
    env = env or DistEnv.one_process("cpu")
    meshes = meshes or Meshes(None, None)
    seed_everything(cfg.seed)
    if cfg.parallel.init == "full":
        model = Transformer(cfg.model, cfg.memory)  # on CPU, identical on every rank
        model.init_weights()
    else:
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.memory)
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
    return model
