"""What machine and code a run ran on: the facts every record names.

    env = run_environment()     # {"commit": "fa05223...", "dirty": False, "torch": "2.13.0", "python": ...,
                                #  "cpu": "AMD EPYC", "cpu_capability": "AVX2", "cores": 2}
    same_environment(a, b)      # True when commit, torch, CPU and its vector unit all match (neither tree dirty)

A record's figures reproduce bit for bit only where these match (the brief's
measurement rule; memlm.launch.continual_study checks a retrained run against
its record either way and says which case it is in). `commit` is the git
commit of the memlm code that ran (None outside a git checkout: an installed
package), `dirty` whether its tracked files differed from that commit.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

CODE = Path(__file__).resolve().parent  # the memlm package: the repository root in a checkout


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_capability() -> str:
    """The vector instructions torch's CPU kernels use on this machine (AVX2, AVX512, ...). Two machines of
    one CPU model name (a virtual machine's "AMD EPYC") can differ in it, and their float results with it."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(CODE), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_environment() -> dict[str, object]:
    """The commit (and whether its tracked files were changed), torch, Python and CPU of this process."""
    import torch

    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return {"commit": commit, "dirty": dirty, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": cpu_model(), "cpu_capability": cpu_capability(), "cores": os.cpu_count()}


def same_environment(a: dict | None, b: dict | None) -> bool:
    """Whether two environments promise bitwise equal runs: the same clean commit, torch, CPU and vector unit
    (an environment recorded before `cpu_capability` was does not promise it)."""
    if not a or not b or a.get("dirty") or b.get("dirty") or not a.get("commit"):
        return False
    return all(a.get(k) is not None and a.get(k) == b.get(k) for k in ("commit", "torch", "cpu", "cpu_capability"))
