"""Shared pieces of the launcher tests: the tiny run and a fake Slurm client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The smallest end-to-end run (a few seconds per rank on a busy CPU).
TINY = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "steps=4", "logging.wandb.mode=disabled"]
HELPERS_DIR = Path(__file__).resolve().parent
TESTS_DIR = HELPERS_DIR.parent
# What a child process needs on PYTHONPATH to import the helpers and the fault suite (pyproject's pytest pythonpath).
TEST_PYTHONPATH = os.pathsep.join([str(HELPERS_DIR), str(TESTS_DIR)])

_FAKES = {
    # Records the submission and answers like sbatch does.
    "sbatch": 'echo "sbatch $*" >> "$FAKE_SLURM_LOG"\necho "Submitted batch job 4242"\n',
    # `show hostnames` -> this machine; `requeue ID` is only recorded.
    "scontrol": 'echo "scontrol $*" >> "$FAKE_SLURM_LOG"\n'
                'if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; fi\n',
    # One task on this machine: drop srun's own options and exec the command,
    # so the batch script's `kill -USR1 $SRUN_PID` reaches torchrun as it would
    # through srun's forwarding. FAKE_SRUN_MODULE swaps the trainer module.
    "srun": 'echo "srun $*" >> "$FAKE_SLURM_LOG"\n'
            'while [[ "${1:-}" == --* ]]; do shift; done\n'
            'args=()\n'
            'for a in "$@"; do\n'
            '  if [ "$a" = memlm.train ] && [ -n "${FAKE_SRUN_MODULE:-}" ]; then a=$FAKE_SRUN_MODULE; fi\n'
            '  args+=("$a")\n'
            'done\n'
            'exec "${args[@]}"\n',
}


def fake_slurm(root: Path) -> tuple[Path, Path]:
    """Write fake sbatch/srun/scontrol into root/bin; returns (bin dir, log file)."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in _FAKES.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return bin_dir, root / "slurm.log"


def slurm_env(bin_dir: Path, log: Path, **extra: str) -> dict[str, str]:
    """The environment of a batch script on a 1-node allocation, job 4242."""
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(log),
               SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", OMP_NUM_THREADS="1")
    env.pop("SLURM_RESTART_COUNT", None)
    env.update(extra)
    return env


def launch(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 300):
    """`python -m memlm.launch ARGS` as a user would run it."""
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "memlm.launch", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)
