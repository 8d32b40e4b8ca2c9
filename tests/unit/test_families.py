"""A memory family is one object (memlm.model.family): the house asks it, never its name.

A family's name appears in a comparison only in the family's own files: a
`kind == "memplus"` (or `in ("memory", "memplus")`) anywhere else is a branch
that a new family would have to find and extend. The remote modeling file an
export ships (hf/remote/) is exempt: it is a copy that runs without memlm and
builds every kind it knows by name."""

from __future__ import annotations

import ast
from pathlib import Path

from memlm.model import families

ROOT = Path(__file__).resolve().parents[2]
SKIP = {"tests", "bench", "docs", ".venv", "runs", "data_cache", ".git", "build", "memlm.egg-info", "configs"}
EXEMPT = ("hf/remote/",)  # the modeling code an export ships: runs without memlm, knows its kinds by name
# Each family's own files (the module that registers it; the product-key families' folder).
OWN = {
    "dense": ("model/ffn.py",),
    "memory": ("model/memory_ffn.py", "memory/"),
    "memplus": ("model/memory_ffn.py", "memory/"),
    "moe": ("model/moe.py",),
    "peer": ("model/peer.py",),
    "ultramem": ("model/ultramem_ffn.py", "memory/"),
}


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    if isinstance(node, ast.Starred):
        return _strings(node.value)
    return []


def _compared_names(tree: ast.AST, kinds: set[str]):
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                yield from ((s, node.lineno) for s in _strings(side) if s in kinds)


def test_every_family_is_listed_here():
    assert {f.kind for f in families()} == set(OWN)


def test_no_family_name_is_compared_outside_its_own_files():
    kinds = set(OWN)
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in SKIP or rel.startswith(".") or rel.startswith(EXEMPT):
            continue
        for kind, line in _compared_names(ast.parse(path.read_text(), rel), kinds):
            if not rel.startswith(OWN[kind]):
                found.append(f"{rel}:{line} compares the family name {kind!r}")
    assert found == [], "ask the family object instead (memlm.model.family):\n" + "\n".join(found)


def test_the_walk_sees_a_comparison():
    tree = ast.parse('if cfg.memory.kind in ("memory", "memplus") or kind == "peer": pass')
    assert sorted(s for s, _ in _compared_names(tree, set(OWN))) == ["memory", "memplus", "peer"]
