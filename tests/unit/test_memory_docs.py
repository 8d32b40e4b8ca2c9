"""The examples in docs/memory.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_standalone_example_runs_and_trains():
    text = DOC.read_text()
    marker = text.index("<!-- standalone-example")
    block = re.search(r"```python\n(.*?)```", text[marker:], re.S).group(1)
    assert len(block.strip().splitlines()) <= 16  # stays a short example
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    logits = namespace["logits"]
    assert logits.shape == (2, 16, 100) and torch.isfinite(logits).all()
    model = namespace["TinyLM"]()
    logits = model(torch.randint(0, 100, (2, 16)))
    logits.logsumexp(-1).mean().backward()
    assert model.memory.values.weight.grad.abs().sum() > 0  # the memory is in the graph


def test_model_example_builds():
    block = next(b for b in _python_blocks() if "build_model" in b)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["cfg"].memory.resolved_layers(24) == [4, 12, 20]
    model = namespace["model"]
    assert model.layers[1].ffn_kind == "memplus"
    assert model(torch.randint(0, 512, (1, 8))).shape == (1, 8, 512)


def test_memory_package_stands_alone():
    """memlm.memory must not pull in the model, trainer, data, evals or launch code."""
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, memlm.memory\n"
        "for m in pkgutil.iter_modules(memlm.memory.__path__):\n"
        "    importlib.import_module('memlm.memory.' + m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[:2] in "
        "[['memlm', p] for p in ('model', 'train', 'data', 'evals', 'launch')]]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
