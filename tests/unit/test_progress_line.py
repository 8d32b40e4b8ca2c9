"""The trainer's console line (memlm.train.progress): what a user watching a run reads."""

from __future__ import annotations

from types import SimpleNamespace

from memlm.train.progress import Progress


def _line(**metrics) -> str:
    progress = Progress.__new__(Progress)  # the line needs only the run's step count
    progress.cfg = SimpleNamespace(steps=100)
    record = {"step": 10, "loss": 1.5, "lr": 3e-3, "grad_norm": 0.25, "tokens_per_s": 1234.0, "peak_mem_gib": 0.5,
              **metrics}
    return progress.console_line(record, eta=60.0)


def test_a_run_that_trains_only_value_tables_shows_their_gradient_norm():
    # finetune=memory|sparse: nothing dense trains, so gnorm alone would read 0 for a run that learns
    line = _line(grad_norm=0.0, value_grad_norm=0.875)
    assert "gnorm 0.000  vgnorm 0.875  tok/s 1,234" in line


def test_a_dense_model_shows_no_value_norm():
    line = _line(value_grad_norm=0.0)
    assert "gnorm 0.250  tok/s 1,234" in line and "vgnorm" not in line
    assert line.startswith("[train] step 10/100  loss 1.5000  lr 3.00e-03")
