"""`pip install .` (not editable) ships the subpackages and the Hydra configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_non_editable_install_imports_and_finds_configs(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(REPO)],
        check=True, cwd=tmp_path,
    )
    assert (target / "memlm" / "configs" / "model" / "373m.yaml").is_file()
    assert (target / "memlm" / "memory" / "fast" / "topk_rows.c").is_file()  # built on first use
    assert (target / "memlm" / "hf" / "remote" / "modeling_memlm.py").is_file()  # copied into exports
    assert not (target / "memlm" / "tests").exists(), "tests must not be installed"
    script = (
        "import memlm, memlm.model, memlm.memory\n"
        "from memlm.config.run import compose\n"
        f"assert memlm.__file__.startswith({str(target)!r}), memlm.__file__\n"
        "print(compose(['model=373m']).model.dim)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1024"
