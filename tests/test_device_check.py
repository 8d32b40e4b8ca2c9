"""bench/device_check.sh: valid bash, every section recorded even when one
fails, and the dry run (tiny models on CPU) passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=1800)


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_failing_sections_are_recorded_and_the_rest_still_runs(tmp_path):
    # `false` as the Python: every section fails at once.
    result = _run(tmp_path, PYTHON="false", SECTIONS="mfu nosync equivalence", DRY_RUN="1")
    assert result.returncode != 0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for section in ("mfu", "nosync", "equivalence"):
        assert any(line.startswith(section) and "FAIL (exit 1)" in line for line in summary.splitlines()), summary
    assert "failed sections: 3" in summary


@pytest.mark.slow
def test_dry_run_passes(tmp_path):
    # compile is left out here only for time (about 2 minutes of CPU
    # compilation); it runs the same run_section plumbing.
    sections = "env kernel_tests kernel_bench mfu nosync equivalence"
    result = _run(tmp_path, PYTHON=sys.executable, SECTIONS=sections, DRY_RUN="1")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == 0, summary + result.stdout[-3000:]
    for section in sections.split():
        line = next(line for line in summary.splitlines() if line.startswith(section))
        assert " ok " in line, line
    assert "RESULT mfu ok" in summary and "RESULT equivalence ok" in summary
    assert (tmp_path / "out" / "mfu.json").exists()
