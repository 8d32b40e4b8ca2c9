"""Every run record under docs/runs/ carries a command main accepts: its command.txt, or where main
refuses what ran (a setting main now rejects as ignored), a command_main.txt beside it with the same
run in the form main takes (issue #50: "recorded commands run at main").

Composing all 200-odd commands takes half a minute, so the test composes one command per shape:
the same override keys and the same fine-tune mode (validation turns on which keys are set and on
the mode; the values of the records' learning rates, seeds and paths are all valid ones)."""

from __future__ import annotations

import shlex
from pathlib import Path

from memlm.config.run import compose
from memlm.errors import ConfigError

RUNS = Path(__file__).parents[2] / "docs" / "runs"
PREFIX = ["OMP_NUM_THREADS=1", "python", "-m", "memlm.train"]


def _command(record: Path) -> list[str]:
    main = record / "command_main.txt"
    args = shlex.split((main if main.is_file() else record / "command.txt").read_text())
    assert args[:4] == PREFIX, f"{record}: a memlm.train command on one thread, got {args[:4]}"
    return args[4:]


def _shape(overrides: list[str]) -> tuple:
    keys = tuple(sorted(o.split("=", 1)[0] for o in overrides))
    mode = next((o for o in overrides if o.startswith("finetune=")), "")
    return keys, mode


def test_every_record_has_a_command_main_accepts():
    records = sorted(p.parent for p in RUNS.rglob("command.txt"))
    assert len(records) > 150  # the capacity, value-lr and continual studies' records
    shapes: dict[tuple, tuple[Path, list[str]]] = {}
    for record in records:
        overrides = _command(record)
        shapes.setdefault(_shape(overrides), (record, overrides))
    refused = []
    for record, overrides in shapes.values():
        try:
            compose(overrides)
        except ConfigError as err:
            refused.append(f"{record.relative_to(RUNS)}: {err}")
    assert not refused, "records whose command main refuses:\n" + "\n".join(refused)


def test_a_command_main_differs_from_what_ran_only_by_what_main_refuses():
    for main in sorted(RUNS.rglob("command_main.txt")):
        ran = shlex.split((main.parent / "command.txt").read_text())
        dropped = [o for o in ran if o not in shlex.split(main.read_text())]
        # finetune.background under finetune=full or memory, which ignore it (the config.yaml has it)
        assert [o.split("=", 1)[0] for o in dropped] == ["finetune.background"], (main, dropped)
