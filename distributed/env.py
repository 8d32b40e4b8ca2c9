"""Process-group setup for one process or a torchrun job.

torchrun (or Slurm's srun running torchrun) sets RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE; without them this is a single process.
NCCL on CUDA with gloo beside it for CPU tensors (async checkpoints), gloo on CPU.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import signal
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from memlm.errors import ConfigError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


def process_group_backend(use_cuda: bool) -> str:
    """NCCL for CUDA tensors and gloo beside it for CPU tensors on GPUs: DCP's
    async_save (checkpoint.async_save) stages on the host and runs its
    collectives on CPU tensors, which an NCCL-only group cannot carry. On CPU, gloo."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def die_with_launcher() -> None:
    """Under torchrun, end this rank when its launcher dies, however it dies.

    torchrun starts each rank in its own session, so a SIGKILL of the agent (an
    OOM kill, `kill -9`, a node agent gone) reaches no rank: they would run on,
    holding the run lock and writing into the run folder. Linux delivers
    PR_SET_PDEATHSIG's signal to a process when its parent exits; the kernel
    then drops the rank's file locks, so a resume can start at once. A plain
    process (no torchrun) is left alone: closing a shell must not kill a
    nohup'd run. Where prctl is missing (not Linux) a warning says so.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as err:
        print(f"[train] warning: this rank cannot follow its launcher's death ({err}): if torchrun is "
              "killed, stop the ranks by hand", flush=True)
        return
    if parent == 1 or os.getppid() != parent:  # the launcher died before the signal was armed
        os._exit(1)


def init_distributed(device: str = "auto") -> DistEnv:
    die_with_launcher()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device", device,
                          "cuda was requested but torch.cuda.is_available() is False; use cpu or auto")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=process_group_backend(use_cuda), device_id=dev if use_cuda else None)
    return DistEnv(rank, world, local_rank, local_world, dev)


def shutdown(synchronize: bool = False) -> None:
    """Destroy the process groups while the interpreter is fully alive;
    with `synchronize` (a run that ended well on every rank), after a barrier.

    A finished Trainer lives on in reference cycles (module hooks, FSDP state)
    that hold its meshes' process groups, so destroy_process_group alone would
    leave gloo's worker threads to interpreter finalization, where a rank can
    abort ("terminate called without an active exception") after a successful
    run; torchrun then sees a failed rank, and a peer node waits out its exit
    barrier. Collecting the cycles first frees them here, in order.

    The barrier: a collective can end on one rank while its last message to
    a peer is still being delivered; a rank that then destroys its group and
    exits can abort the peer's gloo thread the same way (measured: 1 run in
    16 of a 2-rank test without it, 0 in 32 with it). A failed run skips
    it: a peer that never arrives would hang the barrier. A barrier the group
    cannot run (no backend for this device) is reported, and the group destroyed.
    """
    gc.collect()
    if dist.is_initialized():
        if synchronize:
            try:
                dist.barrier()
            except RuntimeError as err:  # e.g. a group with no backend for this process's device
                print(f"[shutdown] no barrier before destroying the process group: {err}", flush=True)
        dist.destroy_process_group()
    gc.collect()


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
    if isinstance(memory_parallel, bool) or not isinstance(memory_parallel, int):
        raise TypeError(f"build_meshes takes memory_parallel as an integer, not {memory_parallel!r}: resolve "
                        "parallel.memory_parallel=auto first (memlm.distributed.memory_hooks.resolve_memory_parallel)")
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
                              f"hybrid needs equal ranks per node "
                              f"(world {env.world_size}, per node {env.local_world_size})")
        shape = (env.world_size // env.local_world_size, env.local_world_size)
        fsdp = init_device_mesh(dev, shape, mesh_dim_names=("replicate", "shard"))
    else:
        fsdp = init_device_mesh(dev, (env.world_size,), mesh_dim_names=("shard",))
    memory = init_device_mesh(
        dev, (env.world_size // memory_parallel, memory_parallel), mesh_dim_names=("mem_replica", "mem_parallel")
    )
    return Meshes(fsdp, memory)
