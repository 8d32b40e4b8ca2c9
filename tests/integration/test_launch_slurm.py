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

from memlm.config.run import CheckpointConfig
from memlm.launch.cli import main
from memlm.launch.slurm import snapshot_code


def _dry_run(capsys, *args: str) -> str:
    """The script `launch slurm --dry-run ARGS` prints (the command must succeed)."""
    rc = main(["slurm", "--dry-run", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def _lines(script: str) -> list[str]:
    return [s.strip() for s in script.splitlines()]


def _srun(script: str) -> str:
    return script[script.index("\nsrun "):script.index("SRUN_PID=$!")]


@pytest.mark.parametrize("nodes,gpus", [(1, 2), (4, 8)])
def test_dry_run_script(tmp_path, capsys, nodes, gpus):
    dump = tmp_path / "run"
    script = _dry_run(capsys, "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--partition", "gpu",
                      "--time", "2-00:00:00", "--account", "acc", "--qos", "high", "--", *TINY, f"dump_dir={dump}")
    for line in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus}",
                 "#SBATCH --partition=gpu", "#SBATCH --time=2-00:00:00", "#SBATCH --account=acc",
                 "#SBATCH --qos=high", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue",
                 f"#SBATCH --output={dump}/launch/slurm-%j.out",
                 'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
                 "trap 'forward_signal USR1' USR1", "trap 'forward_signal TERM' TERM",
                 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in _lines(script), line
    srun = _srun(script)
    assert "--ntasks-per-node=1" in srun and "-m torch.distributed.run" in srun
    assert f'--nnodes "$SLURM_NNODES" --nproc_per_node {gpus}' in srun
    assert '--rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID"' in srun
    assert "-m memlm.train" in srun and f"dump_dir={dump}" in srun and "model.vocab_size=128" in srun
    # resume=auto from the first attempt (torchrun restarts continue too) and after a requeue.
    assert "RESUME=(resume=auto)" in script
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then\n  RESUME=(resume=auto init_from=)' in script
    assert f"export PYTHONPATH={dump}/launch/code" in script
    assert "SIGUSR1" in script.split("PET_SIGNALS_TO_HANDLE=")[1].splitlines()[0]
    assert not dump.exists(), "a dry run writes nothing"
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


# ---- the script run by bash against a fake Slurm whose srun only records what it was given ----------

RECORDING_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_SLURM_LOG"
trap 'echo "srun got USR1" >> "$FAKE_SLURM_LOG"; exit 0' USR1
trap 'echo "srun got TERM" >> "$FAKE_SLURM_LOG"; exit 0' TERM
if [ -n "${FAKE_SRUN_READY:-}" ]; then
  touch "$FAKE_SRUN_READY"
  while true; do sleep 0.1; done
fi
while [[ "${1:-}" == --* ]]; do shift; done
exec "$@"
"""
# The interpreter the launcher is told to use on the nodes: records the node's log folder and torchrun's options.
RECORDING_PYTHON = """#!/bin/bash
echo "python PET_LOG_DIR=$PET_LOG_DIR $*" >> "$FAKE_SLURM_LOG"
"""
# `show job` answers with the job state the test chose (FAKE_JOB_STATE).
STATEFUL_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; fi
if [ "$1 $2" = "show job" ]; then echo "JobId=$3 JobName=run JobState=${FAKE_JOB_STATE:-RUNNING} Reason=None"; fi
"""


def _recording_slurm(tmp_path: Path) -> tuple[Path, Path, Path]:
    """fake_slurm with the recording srun, the stateful scontrol and a recording python."""
    bin_dir, log = fake_slurm(tmp_path)
    for name, body in (("srun", RECORDING_SRUN), ("scontrol", STATEFUL_SCONTROL), ("python", RECORDING_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return bin_dir, log, bin_dir / "python"


def _run_script(script: str, tmp_path: Path, bin_dir: Path, log: Path, **env: str) -> str:
    """Run `script` as Slurm would start the batch shell of job 4242 on a node with 48 CPUs; its output."""
    log.unlink(missing_ok=True)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    job = subprocess.run(["bash", str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                         env=slurm_env(bin_dir, log, SLURM_NODEID="0", SLURM_CPUS_ON_NODE="48", **env))
    assert job.returncode == 0, job.stdout + job.stderr
    return job.stdout


@pytest.mark.parametrize("args,sbatch,cpus", [
    ([], ["#SBATCH --exclusive", "#SBATCH --mem=0"], "48"),  # whole nodes: every CPU and all memory
    (["--cpus-per-task", "64", "--mem", "500G"], ["#SBATCH --cpus-per-task=64", "#SBATCH --mem=500G"], "64"),
])
def test_cpus_and_memory_are_requested_and_reach_srun(tmp_path, capsys, args, sbatch, cpus):
    bin_dir, log, python = _recording_slurm(tmp_path)
    script = _dry_run(capsys, "--nodes", "2", "--gpus-per-node", "8", "--python", str(python), *args, "--", *TINY,
                      f"dump_dir={tmp_path / 'run'}")
    for line in sbatch:
        assert line in _lines(script), line
    assert ("#SBATCH --exclusive" in _lines(script)) == (not args)
    _run_script(script, tmp_path, bin_dir, log)
    srun = [line for line in log.read_text().splitlines() if line.startswith("srun ")]
    # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): the script passes the number itself.
    assert srun[0].startswith(f"srun --ntasks-per-node=1 --cpus-per-task={cpus} --mem=0 "), srun


def test_rendezvous_port_is_the_jobs_own_unless_given(tmp_path, capsys):
    bin_dir, log, python = _recording_slurm(tmp_path)
    base = ["--gpus-per-node", "1", "--python", str(python), "--", *TINY, f"dump_dir={tmp_path / 'run'}"]

    def endpoint(script: str, job_id: str) -> str:
        _run_script(script, tmp_path, bin_dir, log, SLURM_JOB_ID=job_id)
        torchrun = next(line for line in log.read_text().splitlines() if line.startswith("python "))
        return torchrun.split("--rdzv-endpoint ")[1].split()[0]

    derived = _dry_run(capsys, *base)
    assert endpoint(derived, "4242") == "127.0.0.1:24242" and endpoint(derived, "4243") == "127.0.0.1:24243"
    given = _dry_run(capsys, "--port", "29511", *base)
    assert endpoint(given, "4242") == endpoint(given, "4243") == "127.0.0.1:29511"


def test_each_rank_gets_its_own_log(tmp_path, capsys):
    """torchrun writes each rank's stdout and stderr under its --log-dir (PET_LOG_DIR):
    one folder per node and attempt, one file pair per rank (the slow test below reads them)."""
    bin_dir, log, python = _recording_slurm(tmp_path)
    dump = tmp_path / "run"
    script = _dry_run(capsys, "--gpus-per-node", "2", "--python", str(python), "--", *TINY, f"dump_dir={dump}")
    _run_script(script, tmp_path, bin_dir, log, SLURM_RESTART_COUNT="1")
    torchrun = next(line for line in log.read_text().splitlines() if line.startswith("python "))
    assert torchrun.startswith(f"python PET_LOG_DIR={dump}/launch/logs/job4242-attempt2/node0 "
                               "-m torch.distributed.run "), torchrun
    assert " --redirects 3 --tee 3 " in torchrun  # each rank's output to its own files, and to the job's log


@pytest.mark.parametrize("args,sent,state,requeued", [
    ([], "USR1", "RUNNING", True),  # the time limit is near: checkpoint, then requeue
    ([], "TERM", "RUNNING", False),  # Slurm ends the job (preemption, scancel): checkpoint, Slurm decides
    (["--signal", "TERM", "--signal-seconds", "300"], "TERM", "RUNNING", True),
    (["--signal", "TERM", "--signal-seconds", "300"], "TERM", "CANCELLED", False),  # scancel sends SIGTERM too
])
def test_signals_reach_srun_and_requeue(tmp_path, capsys, args, sent, state, requeued):
    bin_dir, log, python = _recording_slurm(tmp_path)
    script = _dry_run(capsys, "--gpus-per-node", "1", "--python", str(python), *args, "--", *TINY,
                      f"dump_dir={tmp_path / 'run'}")
    signal_opt, seconds = (args[1], args[3]) if args else ("USR1", "120")
    assert f"#SBATCH --signal=B:{signal_opt}@{seconds}" in _lines(script)
    assert f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={int(seconds) - 20}" in _lines(script)
    (tmp_path / "job.sbatch").write_text(script)
    ready = tmp_path / "srun_ready"
    job = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=tmp_path, env=slurm_env(bin_dir, log, SLURM_NODEID="0",
                                                                  SLURM_CPUS_ON_NODE="8", FAKE_JOB_STATE=state,
                                                                  FAKE_SRUN_READY=str(ready)))
    try:
        deadline = time.monotonic() + 60  # a liveness guard, not a speed check
        while not ready.exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
            time.sleep(0.05)
        job.send_signal(getattr(signal, f"SIG{sent}"))
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out
    calls = log.read_text().splitlines()
    assert f"srun got {sent}" in calls, calls  # forwarded to srun, which hands it to torchrun and the ranks
    assert ("scontrol requeue 4242" in calls) == requeued, calls
    assert ("requeueing job 4242" in out) == requeued and ("not requeued by this script" in out) != requeued


def test_requeue_without_periodic_checkpoints_is_refused(tmp_path, capsys):
    dump = tmp_path / "run"
    assert main(["slurm", "--dry-run", "--", *TINY, "checkpoint.every=0", f"dump_dir={dump}"]) == 2
    err = capsys.readouterr().err
    assert "invalid config value checkpoint.every=0" in err and "start again from step 0" in err
    assert len(err.strip().splitlines()) == 1, err
    # The default cadence is accepted; one that comes only after the last step is a loud warning.
    assert main(["slurm", "--dry-run", "--", *TINY, f"dump_dir={dump}"]) == 0
    warning = f"WARNING: checkpoint.every={CheckpointConfig().every} >= steps=4: no checkpoint before the run's end"
    assert warning in capsys.readouterr().err
    assert main(["slurm", "--dry-run", "--", *TINY, "checkpoint.every=2", f"dump_dir={dump}"]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert not dump.exists()


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
    (["--mem", "lots", "--"], r"--mem 'lots': a size per node"),
    (["--port", "70000", "--"], r"--port 70000: must be a TCP port"),
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
    _submit(monkeypatch, bin_dir, log, "--gpus-per-node", "2", "--port", str(port), "--", *TINY,
            "checkpoint.every=2", f"dump_dir={dump}")
    job = subprocess.run(["bash", str(dump / "launch" / "job.sbatch")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env=slurm_env(bin_dir, log, SLURM_RESTART_COUNT="1",
                                                                  SLURM_NODEID="0", SLURM_CPUS_ON_NODE="2"))
    assert job.returncode == 0, job.stdout + job.stderr
    assert "attempt 2" in job.stdout and "extra overrides: resume=auto init_from=" in job.stdout
    assert f"resume=auto: no checkpoint in {dump}/checkpoints, starting fresh" in job.stdout
    assert "[train] done" in job.stdout and "training exited with code 0" in job.stdout
    assert f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-id 4242" in log.read_text()
    assert (dump / "checkpoints" / "step_00000004").is_dir()
    # One log per rank, written by the node's torchrun: <job>-<attempt>/node<N>/<rdzv id>_*/attempt_<restart>/<rank>.
    rank_dirs = sorted((dump / "launch" / "logs" / "job4242-attempt2" / "node0").glob("4242_*/attempt_0/*"))
    assert [d.name for d in rank_dirs] == ["0", "1"]
    assert all((d / "stdout.log").is_file() and (d / "stderr.log").is_file() for d in rank_dirs)
    assert "[train] done" in (rank_dirs[0] / "stdout.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("sent,requeued", [("USR1", True), ("TERM", False)])
def test_signal_checkpoints_through_torchrun(tmp_path, monkeypatch, sent, requeued):
    """SIGUSR1 (time limit near) or SIGTERM (Slurm ends the job) to the batch shell -> srun (faked) ->
    torchrun -> rank's handler (the training itself is stubbed by tests/helpers/launch_preempt_train.py);
    the script requeues the job after SIGUSR1 only."""
    bin_dir, log = fake_slurm(tmp_path)
    dump = tmp_path / "run"
    _submit(monkeypatch, bin_dir, log, "--port", str(free_port()), "--", *TINY, f"dump_dir={dump}")
    env = slurm_env(bin_dir, log, FAKE_SRUN_MODULE="launch_preempt_train", PYTHONPATH=TEST_PYTHONPATH,
                    SLURM_NODEID="0", SLURM_CPUS_ON_NODE="1")
    job = subprocess.Popen(["bash", str(dump / "launch" / "job.sbatch")], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240  # generous: a liveness guard, not a speed check
        while not (dump / "ready").exists():
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.2)
        job.send_signal(getattr(signal, f"SIG{sent}"))
        out, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    if requeued:  # after SIGTERM the script exits with torchrun's code, which a signal makes 1
        assert job.returncode == 0, out
    assert "resume=auto" in (dump / "ready").read_text()
    assert (dump / "preempted_at_step").exists(), out  # the rank's callback ran (its checkpoint)
    assert f"SIG{sent}: asking the ranks to checkpoint and stop" in out
    assert ("requeueing job 4242" in out) == requeued
    assert ("scontrol requeue 4242" in log.read_text()) == requeued
    assert (f"stopped by SIG{sent}, not requeued by this script" in out) != requeued
