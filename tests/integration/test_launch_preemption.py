"""memlm.train.preemption: SIGUSR1 or SIGTERM sets a flag; check() agrees across ranks,
runs the checkpoint callback once and tells the loop to stop."""

from __future__ import annotations

import json
import os
import signal

import pytest
from distributed_workers import run_ranks
from launch_preempt_train import stop_together

from memlm.train.preemption import install_preemption_handler


def test_signal_sets_a_flag_and_check_runs_the_callback_once(capsys):
    before = signal.getsignal(signal.SIGUSR1)
    calls = []
    handler = install_preemption_handler(lambda: calls.append("checkpoint"))
    try:
        assert not handler.requested and handler.check() is False and calls == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the process survives: the handler only records it
        assert handler.requested and handler.received == signal.SIGUSR1
        assert calls == [], "nothing runs inside the signal handler"
        assert handler.check() is True and calls == ["checkpoint"]
        assert handler.check() is True and calls == ["checkpoint"]
        assert "SIGUSR1: writing a checkpoint and stopping" in capsys.readouterr().out
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_sigterm_stops_the_run_too():
    """Slurm ends a job (time limit, preemption with a grace time, scancel) with SIGTERM."""
    before = signal.getsignal(signal.SIGTERM)
    handler = install_preemption_handler()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: the handler only records it
        assert handler.received == signal.SIGTERM and handler.check()
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_other_signals_can_be_chosen():
    handler = install_preemption_handler(signals=(signal.SIGUSR2,))
    try:
        signal.raise_signal(signal.SIGUSR2)
        assert handler.received == signal.SIGUSR2 and handler.check()
    finally:
        handler.uninstall()


@pytest.mark.slow
def test_ranks_stop_after_the_same_step_when_one_is_signalled(tmp_path):
    run_ranks(stop_together, 2, str(tmp_path), 1, 5)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in ranks] == [5, 5]
    assert [r["callbacks"] for r in ranks] == [1, 1]  # the checkpoint is collective: every rank runs it
    assert [r["requested"] for r in ranks] == [False, True]
