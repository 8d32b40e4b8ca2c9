"""Runs tests/unit/test_kernels_triton.py and test_kernels_variants.py through
Triton's interpreter on CPU.

Triton decides at kernel definition (import) time whether to interpret, from
TRITON_INTERPRET. Setting it in this process would make every later Triton
import in the pytest run interpreted (and leak into spawned ranks), so the
kernel tests run in a child pytest with the variable set there only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 here: the kernel tests run in this process", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("CUDA present: the kernel tests run the compiled kernels directly", allow_module_level=True)

TESTS = Path(__file__).resolve().parent
FILES = ("test_kernels_triton.py", "test_kernels_variants.py", "test_kernels_launches.py")


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *(str(TESTS / name) for name in FILES), "-q", "-p", "no:cacheprovider"],
        cwd=TESTS.parents[1], env=env, capture_output=True, text=True, timeout=600,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1]
    # Every kernel test ran: nothing skipped or deselected behind a green exit code.
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, report
    print(f"interpreter suite: {summary} (wall {time.perf_counter() - start:.1f} s)")
