"""Every `memlm.x.y` that the README, docs/*.md or the package's source
(docstrings, comments, `--help` texts) names exists: the longest importable
module prefix is imported and the rest looked up as attributes. A name after
`python -m` must be a module itself (one that can be run). A doc that names a
function which is not there sends a user to an AttributeError."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Not the package's own text: tests, runs, caches, installed packages, build output.
SKIP = {"tests", ".venv", "runs", "data_cache", "exports", ".git", "build", "memlm.egg-info"}
# A dotted name starting at `memlm`, not inside a path or a longer word (runs/memlm.x, my_memlm.x).
NAME = re.compile(r"(?<![\w./-])memlm(?:\.[A-Za-z_]\w*)+")
RUN = re.compile(r"-m\s+(memlm(?:\.[A-Za-z_]\w*)+)")


def _texts():
    """(file relative to the repository, its text) of README.md, docs/*.md and every package .py file."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    paths += [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in SKIP]
    for path in paths:
        yield path.relative_to(ROOT), path.read_text(encoding="utf-8")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a prefix is a module, not a package: `name` is an attribute
        return False


def _missing(name: str) -> str | None:
    """None if `name` resolves, else what is missing."""
    parts = name.split(".")
    i = next(i for i in range(len(parts), 0, -1) if _is_module(".".join(parts[:i])))
    obj = importlib.import_module(".".join(parts[:i]))
    for j in range(i, len(parts)):
        if not hasattr(obj, parts[j]):
            return f"{'.'.join(parts[:j])} has no attribute {parts[j]!r}"
        obj = getattr(obj, parts[j])
    return None


def _citations() -> dict[str, list[str]]:
    """{dotted name: ["file:line", ...]} of every citation, `python -m` targets as "-m <name>"."""
    found: dict[str, list[str]] = {}
    for rel, text in _texts():
        for line_no, line in enumerate(text.splitlines(), 1):
            for name in NAME.findall(line):
                found.setdefault(name, []).append(f"{rel}:{line_no}")
            for name in RUN.findall(line):
                found.setdefault(f"-m {name}", []).append(f"{rel}:{line_no}")
    return found


def test_every_cited_memlm_name_exists():
    broken = []
    for cited, where in sorted(_citations().items()):
        if cited.startswith("-m "):
            name = cited.removeprefix("-m ")
            problem = None if _is_module(name) else "not a module `python -m` can run"
        else:
            name, problem = cited, _missing(cited)
        if problem:
            broken.append(f"{name} ({problem}), cited at {', '.join(where)}")
    assert broken == [], "\n".join(broken)


def test_the_walk_sees_the_docs_and_the_help_texts():
    # The walk covers what it claims: a doc, a --help text and a module docstring each cite names.
    cited = {w.split(":")[0] for where in _citations().values() for w in where}
    assert {"README.md", "docs/evals.md", "run/export.py", "evals/formats.py"} <= cited
    assert _missing("memlm.model.no_such_name") == "memlm.model has no attribute 'no_such_name'"

