"""The train CLI's end: the finished Trainer (and with it every FSDP module and
mesh that holds a process group) is freed before the process groups are
destroyed, not left to interpreter finalization (memlm.distributed.env.shutdown)."""

from __future__ import annotations

import gc
import weakref

import torch.distributed

import memlm.distributed.env as env
import memlm.train.trainer as trainer_module
from memlm.train.cli import main

TINY = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "steps=2", "logging.wandb.mode=disabled"]


def test_the_trainer_is_freed_before_the_process_group_is_destroyed(tmp_path, monkeypatch):
    trainers: list[weakref.ref] = []
    alive_at_destroy: list[int] = []
    original_init = trainer_module.Trainer.__init__

    def tracked_init(self, *args, **kwargs):
        trainers.append(weakref.ref(self))
        original_init(self, *args, **kwargs)

    def destroy_process_group():
        alive_at_destroy.append(sum(ref() is not None for ref in trainers))

    class GroupAtShutdown:
        """torch.distributed as env.shutdown sees it: one process, but a group to destroy."""
        def __getattr__(self, name):
            return getattr(torch.distributed, name)

    fake = GroupAtShutdown()
    monkeypatch.setattr(trainer_module.Trainer, "__init__", tracked_init)
    monkeypatch.setattr(env, "dist", fake)
    real_shutdown = env.shutdown

    barriers: list[int] = []

    def shutdown(synchronize=False):  # the train CLI imports it from env when main() runs
        fake.is_initialized = lambda: True
        fake.destroy_process_group = destroy_process_group
        fake.barrier = lambda: barriers.append(len(alive_at_destroy))
        real_shutdown(synchronize)

    monkeypatch.setattr(env, "shutdown", shutdown)
    gc.disable()  # the automatic collector must not free the cycles by chance
    try:
        assert main([*TINY, f"dump_dir={tmp_path}"]) == 0
    finally:
        gc.enable()
    assert len(trainers) == 1, "the CLI did not build one Trainer"
    assert alive_at_destroy == [0], "a Trainer was still alive when the process group was destroyed"
    assert barriers == [0], "a finished run meets its peers in a barrier before destroying the group"


def test_a_failed_run_destroys_its_group_without_a_barrier(monkeypatch):
    """A rank that failed must not wait for peers that may never come."""
    calls = []

    class Dist:
        is_initialized = staticmethod(lambda: True)
        barrier = staticmethod(lambda: calls.append("barrier"))
        destroy_process_group = staticmethod(lambda: calls.append("destroy"))

    monkeypatch.setattr(env, "dist", Dist)
    env.shutdown(synchronize=False)
    env.shutdown(synchronize=True)
    assert calls == ["destroy", "barrier", "destroy"]


def test_a_barrier_the_group_cannot_run_is_reported_and_the_group_still_destroyed(monkeypatch, capsys):
    calls = []

    def no_cpu_backend():
        raise RuntimeError("No backend type associated with device type cpu")

    class Dist:
        is_initialized = staticmethod(lambda: True)
        barrier = staticmethod(no_cpu_backend)
        destroy_process_group = staticmethod(lambda: calls.append("destroy"))

    monkeypatch.setattr(env, "dist", Dist)
    env.shutdown(synchronize=True)
    assert calls == ["destroy"]
    assert "no barrier before destroying the process group: No backend type" in capsys.readouterr().out
