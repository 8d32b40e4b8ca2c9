"""Process-group setup for one process or a torchrun job.

torchrun (or Slurm's srun running torchrun) sets RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE; without them this is a single process.
NCCL on CUDA with gloo beside it for CPU tensors (async checkpoints), gloo on CPU.

A command opens the group once, and the group's end is decided here:

    with ProcessGroup(cfg.device, timeout_s=cfg.parallel.timeout_s) as env:   # env: this process's DistEnv
        Trainer(cfg).fit()                  # the Trainer takes the same env (current_env)

On the way out the group frees what holds it, meets the peers in a barrier
bounded in time (a rank that ended well), and destroys the groups
(`ProcessGroup.close`). A peer that died or never arrives is a PeerLostError
naming it, not a hang; so is a collective that fails mid-run because a peer
was lost (`lost_peer`: it names parallel.timeout_s, the group's timeout).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import random
import re
import signal
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from memlm.errors import ConfigError, MemlmError, launcher_rank

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @classmethod
    def one_process(cls, device: str | torch.device = "cpu") -> DistEnv:
        """A process of its own, with no group: what a loader or a one-process command runs as."""
        return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device(device))

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


def init_distributed(device: str = "auto", backend: str | None = None, timeout_s: int | None = None) -> DistEnv:
    """Join torchrun's process group (none for one process) and return this process's DistEnv.
    `backend`: the group's backend, when not process_group_backend's for the device (the
    evals exchange Python objects only: gloo on GPUs too). `timeout_s`: how long a collective
    waits for a peer (parallel.timeout_s; None: torch's default). ProcessGroup calls it and closes the group."""
    die_with_launcher()
    rank, world = launcher_rank()
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
        backend = backend or process_group_backend(use_cuda)
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, device_id=dev if use_cuda and "nccl" in backend else None,
                                timeout=timeout)
    return DistEnv(rank, world, local_rank, local_world, dev)


END_BARRIER_TIMEOUT = datetime.timedelta(seconds=300)  # a peer alive but not arriving; a dead one is seen at once


class PeerLostError(MemlmError):
    """A peer rank was lost: it did not meet this rank at the end of the run, or a collective
    with it failed mid-run (it died, or did not answer within the group's timeout)."""

    same_on_every_rank = False


# What torch's collectives raise when a peer is gone: the c10d errors, and gloo's transport
# failures, which reach Python as a RuntimeError naming gloo's source file.
_LOST_PEER = re.compile(r"gloo/transport|Connection (?:reset|closed) by peer|Timed out waiting|"
                        r"NCCL communicator was aborted|ncclRemoteError|Watchdog caught collective")


def lost_peer(err: BaseException, timeout_s: int | None) -> PeerLostError | None:
    """The one-line error for a collective that failed mid-run because a peer was lost, else None."""
    if not (isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and _LOST_PEER.search(str(err)))):
        return None
    reason = re.sub(r"^\[[^\]]*\] ?", "", " ".join(str(err).split()))  # gloo's source location
    reason = reason.split(" This is typically caused")[0]  # gloo's generic advice
    wait = f"parallel.timeout_s={timeout_s} s" if timeout_s is not None else "torch's default timeout"
    return PeerLostError(f"a collective with the other ranks failed mid-run: a peer rank failed or died (its log "
                         f"says why), or did not answer within {wait}: {reason}")


class ProcessGroup:
    """The process group of one command: opened on entry, closed on exit.

        with ProcessGroup(cfg.device) as env:         # torchrun's ranks joined; one process: no group
            Trainer(cfg).fit()
        with ProcessGroup(device, backend="gloo") as env:   # the evals: Python objects only

    Closing (`close`, or leaving the with block): collect the reference cycles
    that still hold the groups (a finished Trainer's FSDP state and meshes),
    then, on a rank that ended well, meet the peers in a barrier, then destroy
    the groups, all while the interpreter is fully alive.

    Why collect first: a group left to interpreter finalization can abort a
    finished rank in gloo's worker threads ("terminate called without an
    active exception"); torchrun then sees a failed rank.

    Why the barrier: a collective can end on one rank while its last message
    to a peer is still being delivered; a rank that destroys its group and
    exits then can abort the peer the same way (measured: 1 run in 16 of a
    2-rank test without it, 0 in 32 with it). It is torch's monitored_barrier
    on a gloo group of its own, opened with the group (on GPUs too, beside
    NCCL) with END_BARRIER_TIMEOUT as its timeout: a peer that died is seen at
    once (its connections close), one that is alive but never arrives after
    END_BARRIER_TIMEOUT (gloo waits out a send with its group's timeout, not
    monitored_barrier's, so the default group's 30 minutes would apply); either way this rank
    raises PeerLostError naming the peer, after destroying its groups. A rank
    that failed skips the barrier and leaves at once: its peers then name it.
    """

    current: ProcessGroup | None = None  # the group a command has open (current_env)

    def __init__(self, device: str = "auto", backend: str | None = None, timeout_s: int | None = None):
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s  # a collective's wait for a peer (parallel.timeout_s); None: torch's default
        self.env: DistEnv | None = None
        self._opened = False  # this object joined the default group (and so destroys it)
        self._barrier_group = None  # the end barrier's gloo group, its timeout END_BARRIER_TIMEOUT

    def __enter__(self) -> DistEnv:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ended_well=exc_type is None)
        distributed = self.env is not None and self.env.distributed
        lost = lost_peer(exc, self.timeout_s) if exc is not None and distributed else None
        if lost is not None:  # one line naming the wait, not a collective's traceback
            raise lost from exc

    def open(self) -> DistEnv:
        if ProcessGroup.current is not None:  # inside another command's group (a test's ranks): its env, its close
            self.env = ProcessGroup.current.env
            return self.env
        joined_before = dist.is_initialized()
        self.env = init_distributed(self.device, self.backend, self.timeout_s)
        self._opened = dist.is_initialized() and not joined_before
        if self.env.distributed:  # gloo's sends wait for the group's timeout, not monitored_barrier's
            self._barrier_group = dist.new_group(backend="gloo", timeout=END_BARRIER_TIMEOUT)
        ProcessGroup.current = self
        return self.env

    def close(self, ended_well: bool) -> None:
        """Collect, meet the peers in the bounded barrier (when `ended_well`), destroy the groups."""
        if ProcessGroup.current is not self:
            return  # opened inside another ProcessGroup: that one closes
        ProcessGroup.current = None
        gc.collect()
        lost = None
        try:
            if ended_well and self.env is not None and self.env.distributed and dist.is_initialized():
                lost = self._meet_peers()
        finally:
            if self._opened and dist.is_initialized():
                dist.destroy_process_group()  # every group, the side group too
            gc.collect()
        if lost is not None:
            raise lost

    def _meet_peers(self) -> PeerLostError | None:
        seconds = int(END_BARRIER_TIMEOUT.total_seconds())
        try:
            dist.monitored_barrier(self._barrier_group, timeout=END_BARRIER_TIMEOUT, wait_all_ranks=True)
        except RuntimeError as err:
            return PeerLostError(peer_lost_message(self.env.rank, str(err), seconds))
        return None


def peer_lost_message(rank: int, detail: str, seconds: int) -> str:
    """What a rank that ended well says when monitored_barrier fails: which peer, and torch's reason.
    Rank 0 hears from every rank (torch names the missing ones); any other rank waits for rank 0."""
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", detail)
    waited = re.search(r"send/recv from rank (\d+)", detail)
    peers = (f"rank(s) {missing.group(1).strip()}" if missing else f"rank {waited.group(1)}" if waited
             else "rank 0" if rank else "a peer")
    reason = detail.strip().splitlines()[-1] if detail.strip() else "no reason given"
    reason = re.sub(r"^\[[^\]]*\] ?", "", reason)  # gloo's source location
    return (f"this rank ended well, but {peers} did not meet it at the end of the run (failed or died: "
            f"its log says why; a live peer is waited for {seconds} s): {reason}")


def current_env(device: str = "auto") -> DistEnv:
    """The DistEnv of the open ProcessGroup; a single process's when none is open and no
    launcher started this process. A torchrun rank must open the group first."""
    group = ProcessGroup.current
    if group is not None:
        if device not in ("auto", group.env.device.type):
            raise ConfigError("device", device, f"the device of this process's group, {group.env.device.type} "
                                                f"(ProcessGroup({group.device!r})), or auto")
        return group.env
    if launcher_rank()[1] > 1:
        raise RuntimeError("this torchrun rank has no process group open: run it inside "
                           "`with ProcessGroup(device) as env:` (memlm.distributed.env), as memlm.train's main does")
    return init_distributed(device)


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
