"""Running bench/device_check.sh from the tests, and loading bench/ scripts.

    result = run_device_check(tmp_path, PYTHON=sys.executable, SECTIONS="env", DRY_RUN="1")
    line = summary_line(tmp_path, "env")        # that section's line of $OUT/summary.txt
    gpu_speed = load_bench("gpu_speed")          # bench/gpu_speed.py as a module
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.sh"


def load_bench(name: str):
    """bench/<name>.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_device_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The script with OUT=tmp_path/out and these environment variables set."""
    full = {**os.environ, "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=1800)


def summary_line(tmp_path: Path, section: str) -> str:
    summary = (tmp_path / "out" / "summary.txt").read_text()
    return next(line for line in summary.splitlines() if line.startswith(section + " "))
