"""`python -m memlm.launch local` and torchrun runs on this machine: bad
launches fail before any process starts; 2 ranks, 2 "nodes" (c10d
rendezvous) and an elastic restart train a tiny model end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from distributed_workers import free_port
from launch_helpers import TEST_PYTHONPATH, TINY, launch

import memlm.launch.local as local
from memlm.launch.cli import main
from memlm.launch.local import torchrun_command, torchrun_env


@pytest.fixture
def no_processes(monkeypatch):
    """Any attempt to start a process fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(local.subprocess, "Popen", refuse)
    monkeypatch.setattr(local.subprocess, "run", refuse)


@pytest.mark.parametrize("args,message", [
    (["--nproc", "3", "--", "parallel.memory_parallel=2"],
     r"parallel.memory_parallel=2: a divisor of the world size, but --nproc 3 gives 3 rank\(s\)"),
    (["--nproc", "2", "--", "model.no_such_key=1"], r"model.no_such_key"),
    (["--nproc", "2", "--", "optim.lr=-1"], r"optim.lr=-1.0: a finite number > 0"),
    (["--nproc", "2", "--", "steps=1,2"], r"memlm.launch sweep"),
    (["--nproc", "2", "--", "steps=1,,2"], r"Hydra said"),
    (["--nproc", "0", "--"], r"--nproc 0: must be an integer >= 1"),
    (["--nproc", "2", "--nnodes", "2", "--"], r"--nnodes 2 needs --rdzv-endpoint"),
    (["--nproc", "4", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--", "parallel.memory_parallel=3"],
     r"--nnodes 2 x --nproc 4 gives 8"),
])
def test_bad_local_launch_fails_before_any_process(no_processes, capsys, args, message):
    rc = main(["local", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and re.search(message, err), err


def test_torchrun_command_lines():
    one = torchrun_command(["steps=5"], 2, max_restarts=1, python="py")
    assert one == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "--max-restarts", "1", "-m", "memlm.train", "steps=5"]
    multi = torchrun_command([], 8, nnodes=2, rdzv_endpoint="node0:29500", rdzv_id="job7", python="py")
    assert multi == ["py", "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7", "--nproc_per_node", "8",
                     "-m", "memlm.train"]


def test_help_names_every_command():
    out = launch("--help")
    assert out.returncode == 0 and all(c in out.stdout for c in ("local", "slurm", "sweep", "docs/launch.md"))


@pytest.mark.slow
def test_two_local_ranks_train_end_to_end(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc = main(["local", "--nproc", "2", "--", *TINY, f"dump_dir={tmp_path}"])
    out, err = capfd.readouterr()  # the launcher's and the ranks' output
    assert rc == 0, out + err
    assert "2 rank(s) on cpu" in out and "[launch] done in" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] is not None


@pytest.mark.slow
def test_two_nodes_with_c10d_rendezvous(tmp_path):
    """Two torchrun agents (two "nodes" of one rank each) meet at a c10d
    rendezvous without node ranks; one is plain torchrun as in docs/launch.md,
    the other the launcher. Hybrid FSDP: replicate across the nodes."""
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"test-{uuid.uuid4().hex[:8]}"
    overrides = [*TINY, "checkpoint.every=2", "parallel.fsdp=hybrid", f"dump_dir={tmp_path / 'run'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Output to files, not pipes: a pipe nobody reads while the other node runs can fill and stall
    # an agent, and a failure must show both nodes' output.
    plain_log = tmp_path / "plain.log"
    with plain_log.open("w") as log:
        plain = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                                  "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                                  "-m", "memlm.train", *overrides], stdout=log, stderr=subprocess.STDOUT, text=True,
                                 env=env)
    try:
        other = launch("local", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                       "--", *overrides, env=env)
        try:  # a node whose peer failed waits out torchrun's 300 s exit barrier: do not wait for that
            plain.wait(timeout=120 if other.returncode == 0 else 5)
        except subprocess.TimeoutExpired:
            pass  # killed below; the assertion shows both nodes' output
    finally:
        if plain.poll() is None:
            plain.kill()
            plain.wait()
    both = (f"--- plain torchrun (rc {plain.returncode}):\n{plain_log.read_text()}\n"
            f"--- memlm.launch (rc {other.returncode}):\n{other.stdout}{other.stderr}")
    assert plain.returncode == 0 and other.returncode == 0, both
    assert "2 rank(s) on cpu" in both
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_elastic_restart_resumes_from_newest_checkpoint(tmp_path):
    """Rank 1 dies after step 3 on the first attempt (tests/helpers/launch_elastic_train.py);
    torchrun restarts the group, which resumes from step 2 and finishes at step 6."""
    overrides = [*TINY, "steps=6", "checkpoint.every=2", "resume=auto", "logging.every=1", f"dump_dir={tmp_path}"]
    cmd = torchrun_command(overrides, 2, max_restarts=1)
    cmd[cmd.index("memlm.train")] = "launch_elastic_train"  # the trainer plus the injected failure
    env = torchrun_env(1, dict(os.environ, OMP_NUM_THREADS="1", MEMLM_TEST_CRASH_AT_STEP="3",
                               PYTHONPATH=TEST_PYTHONPATH))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "[test] rank 1 exits at step 3" in text
    assert f"resumed from {tmp_path}/checkpoints/step_00000002 at step 2" in text
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
    # Step 3 ran twice (before the failure and after the restart) with the same loss: an exact resume.
    step3 = re.findall(r"step 3/6\s+loss (\S+)", text)
    assert len(step3) == 2 and step3[0] == step3[1], step3
