"""Shared by the benchmarks: the machine description and the section writer
for docs/benchmarks.md (each benchmark owns one "## ..." section)."""

from __future__ import annotations

import datetime
import os
import re
import statistics
import time
from pathlib import Path

from memlm.machine import cpu_model

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def median_ms(fns: dict, repeats: int = 9) -> dict[str, float]:
    """{name: median milliseconds of fns[name]()}: one warm-up call each, then
    `repeats` rounds that call every function in turn, so a slow phase of a
    shared machine hits all of them alike."""
    times = {name: [] for name in fns}
    for f in fns.values():
        f()
    for _ in range(repeats):
        for name, f in fns.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def machine_line() -> str:
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"Machine: {cpu_model()}, {os.cpu_count()} cores{gpu}; torch {torch.__version__}; "
            f"{datetime.date.today().isoformat()}; load average at start {load:.2f}.")


def write_section(title: str, body: str, path: Path = DOC) -> None:
    """Replace (or append) the section starting with `title`, keep the others.
    `body` may already start with the title line."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    body = body.strip()
    section = f"{body}\n" if body.startswith(title) else f"{title}\n\n{body}\n"
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")
