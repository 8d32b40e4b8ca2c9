"""Long commands say what they are doing (issue 54): `python -m memlm.plan --fit` prints a line per
layout as it is planned (on stderr, so --json stays parseable), and `make setup` a line per stage."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import memlm

ROOT = Path(memlm.__file__).parent
TINY = ["model=tiny", "memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4"]


def test_plan_fit_prints_a_line_per_layout_planned(capsys):
    from memlm.plan.cli import main

    assert main(["--fit", "--world", "4", "--json", *TINY]) == 0
    out, err = capsys.readouterr()
    plans = json.loads(out)
    lines = [line for line in err.splitlines() if line.startswith("[fit] layout ")]
    assert len(lines) == len(plans) == 3, err
    for i, (line, plan) in enumerate(zip(lines, plans), 1):
        assert line.startswith(f"[fit] layout {i}: parallel.memory_parallel={plan['memory_parallel']} "), line
        assert ("fits" if plan["fits"] else "does not fit") in line


def test_make_setup_announces_each_stage():
    # make -n prints the recipe without running it; -W pretends pyproject.toml changed, so the
    # recipe is listed even where .venv is installed.
    shown = subprocess.run(["make", "-n", "-W", "pyproject.toml", "setup"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    stages = [line for line in shown.splitlines() if line.startswith('echo "[setup]')]
    assert [s.split("]")[1].split()[0] for s in stages] == ["1/3", "2/3", "3/3", "done:"], shown
