"""A run's numbers do not move when the house is rearranged: a fixed-seed
Memory+ run, its resume and a fine-tune from it give, bit for bit, the losses,
gradient norms, validation loss, evaluation figures and generated answers
recorded before issue #53's change (tests/records/paths.json, recorded at
cd0b2ea by `python tests/helpers/recorded_paths.py tests/records/paths.json`).
The resume path's validation loss was recorded again when checkpoints began to
keep the validation stream's position: it had restarted the stream, and now
equals the uninterrupted run's, as every other figure of the resume does.

Float arithmetic is only reproducible on the torch build and CPU vector unit
it was recorded on: on another machine the figures are not comparable and the
test says so instead of comparing them. A change that alters the training
arithmetic on purpose records again and says so in its commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recorded_paths import figures, machine

RECORD = Path(__file__).parents[1] / "records" / "paths.json"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    recorded = json.loads(RECORD.read_text())
    if recorded["machine"] != machine():
        pytest.skip(f"figures recorded on {recorded['machine']}; this machine is {machine()}: "
                    "float results are not comparable across torch builds and vector units")
    return recorded["paths"], figures(tmp_path_factory.mktemp("paths"))


@pytest.mark.parametrize("path", ["pretrain", "resume", "finetune"])
def test_figures_equal_the_record(measured, path):
    recorded, now = measured
    assert now[path]["rows"] == recorded[path]["rows"]
    assert now[path]["val_loss"] == recorded[path]["val_loss"]
    assert now[path]["evals"] == recorded[path]["evals"]
    assert now[path]["answers"] == recorded[path]["answers"]


def test_resume_continues_the_run_it_stopped():
    """The record itself: the resumed run's steps are the uninterrupted run's."""
    recorded = json.loads(RECORD.read_text())["paths"]
    assert recorded["resume"]["rows"] == recorded["pretrain"]["rows"]
    assert recorded["resume"]["val_loss"] == recorded["pretrain"]["val_loss"]
    assert recorded["resume"]["answers"] == recorded["pretrain"]["answers"]
