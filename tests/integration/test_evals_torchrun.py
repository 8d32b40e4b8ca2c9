"""`python -m memlm.evals` under `torchrun --nproc_per_node 2` ends cleanly every
time: its gloo group is opened and closed by memlm.distributed.env.ProcessGroup
(collect, bounded barrier, destroy), so no rank aborts in gloo at exit
("terminate called without an active exception") and torchrun reports success.

Before: the evals CLI destroyed its own group with no collect and no barrier,
the order that made 1 training run in 16 abort at exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from evals_fixtures import train_tiny_run

RUNS = 20


@pytest.mark.slow
def test_evals_under_torchrun_exits_cleanly_20_times_out_of_20(tmp_path):
    run = train_tiny_run(tmp_path / "run", tmp_path / "cache")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failures = []
    for i in range(RUNS):
        out = tmp_path / f"evals_{i}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "memlm.evals", f"checkpoint={run}", "tasks=[synthetic_qa]", "limit=4", "device=cpu",
             f"out={out}"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        text = proc.stdout + proc.stderr
        if proc.returncode != 0 or "terminate called" in text or "Traceback" in text or not out.is_file():
            failures.append(f"--- run {i + 1}: exit {proc.returncode}\n{text[-2000:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs did not end cleanly:\n" + "\n".join(failures)
