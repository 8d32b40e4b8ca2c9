"""Process-group setup for one process or a torchrun job.

torchrun (or Slurm's srun running torchrun) sets RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE; without them this is a single process.
NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from memlm.errors import ConfigError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistEnv:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device", device, "cuda was requested but torch.cuda.is_available() is False; use cpu or auto")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return DistEnv(rank, world, local_rank, local_world, dev)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initialization before sharding."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Meshes:
    """The device meshes of a run.

    fsdp: 1-D over all ranks ("shard"), or 2-D ("replicate", "shard") for
        hybrid sharding: shard within a node, replicate across nodes.
    memory: 2-D ("mem_replica", "mem_parallel"): consecutive groups of
        `memory_parallel` ranks each hold one column-sharded copy of the
        value table; ranks with the same column slice form a replica group.
    """

    fsdp: DeviceMesh | None
    memory: DeviceMesh | None


def shard_index(meshes: Meshes, env: DistEnv) -> int:
    """This rank's position along the FSDP shard dimension: equal for the
    replicas of one shard under hybrid sharding, the rank otherwise."""
    if meshes.fsdp is not None and meshes.fsdp.ndim == 2:
        return meshes.fsdp.get_local_rank("shard")
    return env.rank


def build_meshes(env: DistEnv, memory_parallel: int, fsdp_mode: str) -> Meshes:
    if env.world_size % memory_parallel:
        raise ConfigError(
            "parallel.memory_parallel", memory_parallel,
            f"a divisor of the world size {env.world_size} (ranks are grouped {memory_parallel} by {memory_parallel})",
        )
    if not env.distributed:
        return Meshes(None, None)
    dev = env.device.type
    if fsdp_mode == "hybrid":
        if env.world_size % env.local_world_size:
            raise ConfigError("parallel.fsdp", fsdp_mode,
                              f"hybrid needs equal ranks per node (world {env.world_size}, per node {env.local_world_size})")
        shape = (env.world_size // env.local_world_size, env.local_world_size)
        fsdp = init_device_mesh(dev, shape, mesh_dim_names=("replicate", "shard"))
    else:
        fsdp = init_device_mesh(dev, (env.world_size,), mesh_dim_names=("shard",))
    memory = init_device_mesh(
        dev, (env.world_size // memory_parallel, memory_parallel), mesh_dim_names=("mem_replica", "mem_parallel")
    )
    return Meshes(fsdp, memory)
