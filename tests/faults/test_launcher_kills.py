"""Kills a user meets in the first hour (issue 31): a resumed run's metrics
hold one row per step, and ranks die with a SIGKILLed torchrun.

- kill + resume: metrics.jsonl, as every reader of it sees it, has each step
  once (the killed attempt's rows past the checkpoint move to
  metrics.abandoned.jsonl, nothing is lost), and the sweep table reads it;
- SIGKILL of the torchrun agent alone (not its process group): its ranks
  exit within seconds, the run lock is free, and `resume=auto` finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from faults.harness import BASE, EVERY, STEPS, TIMEOUT, last_step, rank_pid, train
from memlm.launch.local import torchrun_command, torchrun_env
from memlm.studies.ablation_report import _last_usage
from memlm.train.metrics import ABANDONED

pytestmark = pytest.mark.slow  # end-to-end runs of the CLI, killed and resumed


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kill_and_resume_leave_one_row_per_step(tmp_path):
    run = tmp_path / "run"
    assert train(run, kill_at_step=EVERY + 3).killed  # checkpoint at 4, rows up to >= 7
    killed_rows = [r for r in rows(run / "metrics.jsonl") if "loss" in r]
    assert max(r["step"] for r in killed_rows) > EVERY
    result = train(run)  # the same command again: resume=auto is the default
    assert result.returncode == 0, result.tail()
    assert f"at step {EVERY}" in result.output and "moved to" in result.output
    steps = [r["step"] for r in rows(run / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    abandoned = rows(run / ABANDONED)  # the killed attempt's rows past step 4, kept aside
    assert abandoned and all(r["abandoned_at_step"] == EVERY and r["step"] > EVERY for r in abandoned
                             if "unreadable" not in r)
    final = next(r for r in rows(run / "metrics.jsonl") if r.get("step") == STEPS and "loss" in r)
    # a reader of metrics.jsonl: the ablation report's usage column
    assert _last_usage(run / "metrics.jsonl") == [v for k, v in final.items() if k.endswith("/usage")] != []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_ranks_die_with_a_sigkilled_torchrun(tmp_path):
    run = tmp_path / "run"
    overrides = [*BASE, f"dump_dir={run}", "steps=100000", "checkpoint.every=2"]
    env = torchrun_env(0, dict(os.environ, OMP_NUM_THREADS="1"))
    log = (tmp_path / "torchrun.log").open("w")
    agent = subprocess.Popen(torchrun_command(overrides, 2), stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while last_step(run) < 3:
            assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.05)
        ranks = [rank_pid(agent.pid, r) for r in (0, 1)]
        os.kill(agent.pid, signal.SIGKILL)  # the agent only: its ranks sit in their own sessions
        agent.wait()
        gone = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not any(_alive(p) for p in ranks), "ranks outlived their torchrun"
    finally:
        for pid in [agent.pid, *locals().get("ranks", [])]:  # whatever still runs, if the test failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    result = train(run, "steps=8", "checkpoint.every=2")  # the lock is free: the run resumes and ends
    assert result.returncode == 0, result.tail()
    assert "resumed from" in result.output and "in use by another run" not in result.output
