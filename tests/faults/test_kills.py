"""Faults a run survives today: each resumes and ends bitwise equal to the uninterrupted run.

- SIGKILL at every point of a save (tests/faults/fault_train.py names them);
- a corrupted newest checkpoint shard: the resume falls back to the previous checkpoint;
- a full disk (`ulimit -f`) during a save: the save fails, the previous checkpoint stays;
- a rank SIGKILLed under `torchrun --max-restarts 1`: the group restarts from the newest checkpoint.

Each compares every logged step's loss (in every attempt) and the final
checkpoint's tensors (model and optimizer) with an uninterrupted run of the same
config (tests/faults/harness.py). Runs are the real CLI in subprocesses.
"""

from __future__ import annotations

import pytest

from faults.harness import EVERY, STEPS, assert_same_run, checkpoints, corrupt, train

pytestmark = pytest.mark.slow  # each test is several end-to-end runs of the CLI


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted one-process run."""
    dump_dir = tmp_path_factory.mktemp("reference") / "run"
    result = train(dump_dir)
    assert result.returncode == 0, result.tail()
    return dump_dir


def test_sigkill_at_every_point_of_a_save(reference, tmp_path):
    run = tmp_path / "run"
    points = ["begin", "shards", "meta", "rename", "latest"]  # the saves of steps 4, 8, 12, 16, 20
    for i, point in enumerate(points):
        step = EVERY * (i + 1)
        result = train(run, "resume=auto", kill_at=f"{point}:{step}")
        assert result.returncode == -9 and f"SIGKILL at {point} of the save of step {step}" in result.output, \
            f"never killed at {point}:{step}\n{result.tail()}"
    final = train(run, "resume=auto")
    assert final.returncode == 0, final.tail()
    assert_same_run(reference, run)


@pytest.mark.parametrize("how", ["bitflip", "truncate"])
def test_corrupt_newest_shard_falls_back_to_previous_checkpoint(reference, tmp_path, how):
    run = tmp_path / "run"
    assert train(run, kill_at_step=2 * EVERY + 1).killed
    *_, previous, newest = checkpoints(run)
    corrupt(next(newest.glob("__0_*.distcp")), how)
    result = train(run, "resume=auto")
    assert result.returncode == 0, result.tail()
    assert f"skipping {newest}" in result.output
    assert f"resumed from {previous} at step {int(previous.name[5:])}" in result.output
    assert_same_run(reference, run)


def test_disk_full_during_a_save(reference, tmp_path):
    run = tmp_path / "run"
    assert train(run, kill_at_step=EVERY + 1).killed  # a checkpoint exists at step 4
    good = checkpoints(run)[-1]
    # Every save's shard file is larger than 256 KiB: the next save fails with EFBIG ("File too large").
    full = train(run, "resume=auto", fsize_limit=256 << 10)
    assert full.returncode not in (0, -9), full.tail()
    assert "File too large" in full.output, full.tail()
    assert checkpoints(run)[-1] == good and (run / "checkpoints" / "latest").read_text().strip() == good.name
    result = train(run, "resume=auto")
    assert result.returncode == 0 and f"resumed from {good}" in result.output, result.tail()
    assert_same_run(reference, run)


def test_elastic_restart_after_a_rank_is_killed(tmp_path):
    """torchrun --max-restarts 1: rank 1 SIGKILLed from outside; the group restarts from the newest checkpoint.

    tests/integration/test_launch_local.py::test_elastic_restart_resumes_from_newest_checkpoint covers a rank
    that exits by itself (tests/helpers/launch_elastic_train.py) and compares one step's loss."""
    reference = tmp_path / "reference"
    assert train(reference, nproc=2).returncode == 0
    run = tmp_path / "run"
    result = train(run, "resume=auto", nproc=2, max_restarts=1, kill_at_step=EVERY + 2, kill_rank=1)
    assert result.returncode == 0, result.tail()
    assert f"resumed from {run}/checkpoints/step_{EVERY:08d}" in result.output \
        or f"resumed from {run}/checkpoints/step_{2 * EVERY:08d}" in result.output, result.tail()
    assert_same_run(reference, run, STEPS)
