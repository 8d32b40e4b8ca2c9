"""The test harness's ranks (tests/helpers/distributed_workers.run_ranks) start
from a fork server that has imported torch, yet see what a spawned rank would:
the test's environment as it is at the call (not as it was when the server
started), and Triton unimported, so a rank can still choose its interpreter."""

from __future__ import annotations

import subprocess
import sys

from distributed_workers import FORK_SERVER_PRELOAD, environ_value, run_ranks


def test_the_fork_servers_imports_leave_triton_unimported():
    probe = f"import sys\nfor m in {FORK_SERVER_PRELOAD!r}: __import__(m)\nprint('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_rank_sees_the_environment_of_the_call(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLM_RUN_RANKS_PROBE", "first")
    run_ranks(environ_value, 2, "MEMLM_RUN_RANKS_PROBE", str(tmp_path))  # the server starts here, if not before
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["first", "first"]
    monkeypatch.setenv("MEMLM_RUN_RANKS_PROBE", "second")
    run_ranks(environ_value, 2, "MEMLM_RUN_RANKS_PROBE", str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["second", "second"]
    monkeypatch.delenv("MEMLM_RUN_RANKS_PROBE")
    run_ranks(environ_value, 2, "MEMLM_RUN_RANKS_PROBE", str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["<unset>", "<unset>"]
