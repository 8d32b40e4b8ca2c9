"""`python -m memlm.launch slurm`: the generated script, the submission, the
code snapshot, and the script itself run against a fake Slurm client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_workers import free_port
from launch_helpers import TEST_PYTHONPATH, TINY, fake_slurm, launch, slurm_env

from memlm.launch.cli import main
from memlm.launch.slurm import snapshot_code


@pytest.mark.parametrize("nodes,gpus", [(1, 2), (4, 8)])
def test_dry_run_script(tmp_path, capsys, nodes, gpus):
    dump = tmp_path / "run"
    rc = main(["slurm", "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--partition", "gpu",
               "--time", "2-00:00:00", "--account", "acc", "--qos", "high", "--dry-run", "--", *TINY,
               f"dump_dir={dump}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    script = out
    for line in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus}",
                 "#SBATCH --partition=gpu", "#SBATCH --time=2-00:00:00", "#SBATCH --account=acc",
                 "#SBATCH --qos=high", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue",
                 f"#SBATCH --output={dump}/launch/slurm-%j.out",
                 'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
                 "trap forward_signal USR1", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in [s.strip() for s in script.splitlines()], line
    srun = script[script.index("\nsrun "):script.index("SRUN_PID=$!")]
    assert "--ntasks-per-node=1" in srun and "-m torch.distributed.run" in srun
    assert f'--nnodes "$SLURM_NNODES" --nproc_per_node {gpus}' in srun
    assert '--rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID"' in srun
    assert "-m memlm.train" in srun and f"dump_dir={dump}" in srun and "model.vocab_size=128" in srun
    assert "RDZV_PORT=29500" in script
    # resume=auto from the first attempt (torchrun restarts continue too) and after a requeue.
    assert "RESUME=(resume=auto)" in script
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then\n  RESUME=(resume=auto init_from=)' in script
    assert f"export PYTHONPATH={dump}/launch/code" in script
    assert "SIGUSR1" in script.split("PET_SIGNALS_TO_HANDLE=")[1].splitlines()[0]
    assert not dump.exists(), "a dry run writes nothing"
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_init_from_starts_the_run_and_restarts_continue_it(capsys, tmp_path):
    rc = main(["slurm", "--gpus-per-node", "1", "--max-restarts", "2", "--dry-run", "--", *TINY,
               f"dump_dir={tmp_path}", "init_from=/ckpt/step_100"])
    script = capsys.readouterr().out
    assert rc == 0
    # First attempt: init_from starts the run, a torchrun restart continues from its own checkpoint.
    assert "RESUME=(resume=auto)" in script
    assert "RESUME=(resume=auto init_from=)" in script
    assert "--max-restarts 2" in script
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script  # elastic restarts need it


@pytest.mark.parametrize("args,message", [
    (["--nodes", "4", "--gpus-per-node", "8", "--", "parallel.memory_parallel=3"],
     r"parallel.memory_parallel=3.*--nodes 4 x --gpus-per-node 8 gives 32"),
    (["--time", "tomorrow", "--"], r"--time 'tomorrow'.*HH:MM:SS"),
    (["--nodes", "0", "--"], r"--nodes 0: must be an integer >= 1"),
    (["--", "optim.nope=1"], r"optim.nope"),
])
def test_bad_slurm_launch_fails_early(tmp_path, capsys, args, message):
    import re

    rc = main(["slurm", "--dry-run", *args, f"dump_dir={tmp_path / 'x'}"])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err), err
    assert not (tmp_path / "x").exists()


def test_missing_sbatch_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rc = main(["slurm", "--gpus-per-node", "1", "--", *TINY, f"dump_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "sbatch not found on PATH" in err and "--dry-run" in err
    assert not (tmp_path / "run").exists(), "nothing is written when the job cannot be submitted"


def test_submission_writes_snapshot_config_and_calls_sbatch(tmp_path):
    bin_dir, log = fake_slurm(tmp_path)
    dump = tmp_path / "run"
    out = launch("slurm", "--nodes", "2", "--gpus-per-node", "4", "--", *TINY, f"dump_dir={dump}",
                 env=slurm_env(bin_dir, log), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "submitted job 4242" in out.stdout
    assert log.read_text().strip() == f"sbatch {dump}/launch/job.sbatch"
    code = dump / "launch" / "code" / "memlm"
    assert (code / "train" / "trainer.py").is_file() and (code / "configs" / "config.yaml").is_file()
    copied = {p.name for p in code.rglob("*")}
    assert not copied & {"__pycache__", ".git", "runs", "data_cache", ".venv"}
    assert "vocab_size: 128" in (dump / "launch" / "config.yaml").read_text()
    # The job imports the snapshot, not this checkout (PYTHONPATH wins over the editable install).
    where = subprocess.run([sys.executable, "-c", "import memlm; print(memlm.__file__)"], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(code.parent)), cwd=tmp_path)
    assert where.stdout.strip() == str(code / "__init__.py")


def test_snapshot_excludes_outputs_and_its_own_destination(tmp_path):
    src = tmp_path / "pkg"
    for rel in ("__init__.py", "train/a.py", "train/__pycache__/a.pyc", "runs/r/x", "data_cache/d",
                ".git/HEAD", ".venv/bin/python", "memlm.egg-info/PKG-INFO", "mine/other/f"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("x")
    dest = src / "mine" / "run" / "launch" / "code"  # a run directory inside the checkout
    files, _ = snapshot_code(dest, src)
    got = sorted(str(p.relative_to(dest / "memlm")) for p in (dest / "memlm").rglob("*") if p.is_file())
    assert got == ["__init__.py", "train/a.py"] and files == 2


def _submit(monkeypatch, bin_dir: Path, log: Path, *args: str) -> None:
    """Submit a 1-node, 1-rank job through the fake sbatch."""
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(log))
    assert main(["slurm", "--nodes", "1", "--gpus-per-node", "1", *args]) == 0


@pytest.mark.slow
def test_requeued_batch_script_trains_with_resume_auto(tmp_path, monkeypatch):
    """The submitted script, run as Slurm runs a requeued attempt on one node:
    real torchrun with c10d rendezvous at the first node, the code snapshot,
    and the requeue overrides (resume=auto init_from=) reaching the trainer."""
    bin_dir, log = fake_slurm(tmp_path)
    dump = tmp_path / "run"
    port = free_port()
    _submit(monkeypatch, bin_dir, log, "--port", str(port), "--", *TINY, "checkpoint.every=2", f"dump_dir={dump}")
    job = subprocess.run(["bash", str(dump / "launch" / "job.sbatch")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env=slurm_env(bin_dir, log, SLURM_RESTART_COUNT="1"))
    assert job.returncode == 0, job.stdout + job.stderr
    assert "attempt 2" in job.stdout and "extra overrides: resume=auto init_from=" in job.stdout
    assert f"resume=auto: no checkpoint in {dump}/checkpoints, starting fresh" in job.stdout
    assert "[train] done" in job.stdout and "training exited with code 0" in job.stdout
    assert f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-id 4242" in log.read_text()
    assert (dump / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.slow
def test_sigusr1_checkpoints_through_torchrun_and_requeues(tmp_path, monkeypatch):
    """SIGUSR1 to the batch shell -> srun (faked) -> torchrun -> rank's handler
    (the training itself is stubbed by tests/helpers/launch_preempt_train.py) -> requeue."""
    bin_dir, log = fake_slurm(tmp_path)
    dump = tmp_path / "run"
    _submit(monkeypatch, bin_dir, log, "--port", str(free_port()), "--", *TINY, f"dump_dir={dump}")
    env = slurm_env(bin_dir, log, FAKE_SRUN_MODULE="launch_preempt_train", PYTHONPATH=TEST_PYTHONPATH)
    job = subprocess.Popen(["bash", str(dump / "launch" / "job.sbatch")], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240  # generous: a liveness guard, not a speed check
        while not (dump / "ready").exists():
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)
        out, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out
    assert "resume=auto" in (dump / "ready").read_text()
    assert (dump / "preempted_at_step").exists(), out  # the rank's callback ran (its checkpoint)
    assert "SIGUSR1 (time limit near)" in out and "requeueing job 4242" in out
    assert "scontrol requeue 4242" in log.read_text()
