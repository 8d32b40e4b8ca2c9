"""A command's `main(argv)` run in-process, seen as a shell would see it:
its exit status and what it printed. For the tests that only check how a
command refuses bad input (a ConfigError is exit 2 and one line on stderr),
where starting a whole interpreter would cost seconds and test nothing more.

    result = run_main("memlm.train", "stpes=10", capsys=capsys)
    assert result.returncode == 2 and result.stderr == "error: unknown key stpes; ...\n"
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# `python -m X` -> the module whose main(argv) it runs.
MAINS = {"memlm.train": "memlm.train.cli", "memlm.launch": "memlm.launch.cli", "memlm.evals": "memlm.evals.cli"}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_main(module: str, *argv: str, capsys) -> Result:
    main = importlib.import_module(MAINS.get(module, module)).main  # or a module path: memlm.train.slot_usage
    capsys.readouterr()  # drop what the test printed before
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors and --help
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return Result(code, out, err)
