"""memlm.distributed.env.ProcessGroup's end, on a stand-in for torch.distributed:
what still holds the groups is collected first, a rank that ended well meets
its peers in the bounded barrier, then the groups are destroyed; a rank that
failed skips the barrier; a barrier a peer never reached is a PeerLostError
naming it, raised after the groups are gone. The real 2-rank runs are in
tests/faults/test_peer_lost.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import memlm.distributed.env as env
from memlm.distributed.env import DistEnv, PeerLostError, ProcessGroup


class Calls(list):
    """The stand-in's calls, in order, and weak references to the holders."""


class Holder:
    """Stands for a finished Trainer: freed only by the cycle collector."""

    def __init__(self):
        self.me = self


@pytest.fixture
def calls(monkeypatch):
    calls = Calls()
    holders: list[weakref.ref] = []

    class Dist:
        is_initialized = staticmethod(lambda: bool(calls) and calls[0] == "init")
        DistError = torch.distributed.DistError  # what the process group's exit path tells a lost peer by

        @staticmethod
        def new_group(backend=None, timeout=None):
            calls.append(("end group", backend, timeout))
            return "end group"

        @staticmethod
        def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
            calls.append(("barrier", group, sum(h() is not None for h in holders), timeout, wait_all_ranks))

        @staticmethod
        def destroy_process_group():
            calls.append(("destroy", sum(h() is not None for h in holders)))

    def init_distributed(device="auto", backend=None, timeout_s=None):
        calls.append("init")
        return DistEnv(1, 2, 1, 2, torch.device("cpu"))

    monkeypatch.setattr(env, "dist", Dist)
    monkeypatch.setattr(env, "init_distributed", init_distributed)
    calls.holders = holders  # type: ignore[attr-defined]
    return calls


def _hold(calls) -> None:
    calls.holders.append(weakref.ref(Holder()))


def test_a_rank_that_ended_well_collects_then_meets_its_peers_then_destroys(calls):
    gc.disable()  # the automatic collector must not free the cycle by chance
    try:
        with ProcessGroup("cpu") as group_env:
            assert group_env.world_size == 2 and env.current_env() is group_env
            _hold(calls)
    finally:
        gc.enable()
    timeout = env.END_BARRIER_TIMEOUT
    assert calls == ["init", ("end group", "gloo", timeout), ("barrier", "end group", 0, timeout, True),
                     ("destroy", 0)]
    assert ProcessGroup.current is None


def test_a_rank_that_failed_skips_the_barrier_and_still_destroys(calls):
    with pytest.raises(KeyError):
        with ProcessGroup("cpu"):
            raise KeyError("boom")
    assert calls == ["init", ("end group", "gloo", env.END_BARRIER_TIMEOUT), ("destroy", 0)]


def test_a_peer_that_never_came_is_a_peer_lost_error_after_the_groups_are_gone(calls, monkeypatch):
    def lost(group=None, timeout=None, wait_all_ranks=False):
        calls.append("barrier")
        raise RuntimeError("Rank 1 successfully reached monitoredBarrier, but received errors while waiting for "
                           "send/recv from rank 0.\n Original exception: \n[../gloo/transport/tcp/pair.cc:553] "
                           "Connection closed by peer [127.0.0.1]:29070")

    monkeypatch.setattr(env.dist, "monitored_barrier", staticmethod(lost))
    with pytest.raises(PeerLostError) as err:
        with ProcessGroup("cpu"):
            pass
    assert calls[2:] == ["barrier", ("destroy", 0)]
    assert "rank 0 did not meet it at the end of the run" in str(err.value)
    assert str(err.value).endswith("Connection closed by peer [127.0.0.1]:29070")


def test_rank_0_names_the_ranks_torch_names():
    detail = "Ranks 1, 3 failed to pass monitoredBarrier in 300000 ms"
    assert "but rank(s) 1, 3 did not meet it" in env.peer_lost_message(0, detail, 300)


def test_a_group_opened_inside_another_is_that_ones(calls):
    with ProcessGroup("cpu") as outer:
        with ProcessGroup("cpu", backend="gloo") as inner:  # a command run by a test's ranks
            assert inner is outer
        assert ProcessGroup.current is not None and len(calls) == 2
    assert calls[-1] == ("destroy", 0)


def test_a_torchrun_rank_without_an_open_group_is_told_to_open_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="with ProcessGroup"):
        env.current_env()
