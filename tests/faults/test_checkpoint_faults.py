"""Faults of the checkpoint lifecycle (issue 21, items 3, 4, 5, 6, 8): rollbacks,
edited or malformed metadata, two runs on one dump_dir, a kill inside a
re-save, a requeue of a finished run, and the error lines users see."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fault_injection import corrupt_shard
from launch_helpers import TINY

from memlm.checkpoint.checkpointer import CheckpointError, verify
from memlm.config.run import compose
from memlm.train.trainer import Trainer

BASE = [o for o in TINY if not o.startswith("steps=")] + ["logging.every=1"]


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A finished run: step_00000002 and step_00000004 (every=2, keep=2)."""
    run = tmp_path_factory.mktemp("template") / "run"
    Trainer(compose([*BASE, "steps=4", "checkpoint.every=2", f"dump_dir={run}"])).fit()
    return run


@pytest.fixture
def run(four_steps, tmp_path) -> Path:
    """A private copy of the finished run, to damage."""
    return Path(shutil.copytree(four_steps, tmp_path / "run"))


# ---------------------------------------------------------------- item 3: lineage
def test_rollback_keeps_new_checkpoint_and_sets_later_ones_aside(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(compose([*BASE, "steps=6", "checkpoint.every=2", "checkpoint.keep_every=2", f"dump_dir={run}"])).fit()
    root = run / "checkpoints"
    assert _names(root) == ["latest", "step_00000002", "step_00000004", "step_00000006"]
    # Roll back to step 2 and train to 3: the save of step 3 must survive pruning.
    Trainer(compose([*BASE, "steps=3", "checkpoint.every=2", "checkpoint.keep_every=2", f"dump_dir={run}",
                     f"resume={root / 'step_00000002'}"])).fit()
    out = capsys.readouterr().out
    abandoned = [p for p in root.iterdir() if p.name.startswith("abandoned_")]
    assert len(abandoned) == 1 and _names(abandoned[0]) == ["step_00000004", "step_00000006"]
    assert str(abandoned[0]) in out and "step_00000004, step_00000006" in out
    assert (root / "latest").read_text().strip() == "step_00000003"
    verify(root / "step_00000003")
    # The next resume continues this lineage, never the abandoned step 6.
    assert Trainer(compose([*BASE, "steps=3", f"dump_dir={run}", "resume=auto"])).step == 3


def test_fresh_start_after_all_checkpoints_fail_keeps_its_save(run, capsys):
    root = run / "checkpoints"
    for name in ("step_00000002", "step_00000004"):
        corrupt_shard(root / name)
    Trainer(compose([*BASE, "steps=1", "checkpoint.keep=1", f"dump_dir={run}", "resume=auto"])).fit()
    assert "starting fresh" in capsys.readouterr().out
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert [p.name for p in root.iterdir() if p.name.startswith("step_")] == ["step_00000001"]
    assert Trainer(compose([*BASE, "steps=1", f"dump_dir={run}", "resume=auto"])).step == 1


# ---------------------------------------------------------------- item 4: meta.json is checked
def _edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, **changes}))


def test_edited_step_in_meta_is_refused_and_auto_falls_back(run, capsys):
    newest = run / "checkpoints" / "step_00000004"
    _edit_meta(newest, step=30)
    with pytest.raises(CheckpointError, match=r"step_00000004/meta\.json"):
        verify(newest)
    t = Trainer(compose([*BASE, "steps=6", f"dump_dir={run}", "resume=auto"]))
    assert t.step == 2
    assert "step_00000004/meta.json" in capsys.readouterr().out


def test_meta_whose_step_disagrees_with_its_folder_is_refused(run):
    """Even with a valid crc32 of its own (a copy under another name, say)."""
    root = run / "checkpoints"
    shutil.copytree(root / "step_00000002", root / "step_00000008")
    with pytest.raises(CheckpointError, match=r"says step 2 but its folder is step_00000008"):
        verify(root / "step_00000008")


@pytest.mark.parametrize("content", ["{}", "[1, 2]", '"step"', "{\"step\": \"4\"}"])
def test_malformed_meta_falls_back_naming_the_file(run, capsys, content):
    (run / "checkpoints" / "step_00000004" / "meta.json").write_text(content)
    t = Trainer(compose([*BASE, "steps=6", f"dump_dir={run}", "resume=auto"]))
    assert t.step == 2
    out = capsys.readouterr().out
    assert "skipping" in out and "step_00000004/meta.json is malformed" in out


def test_every_skipped_folder_is_named(run, capsys):
    root = run / "checkpoints"
    (root / "step_00000009").mkdir()  # no meta.json: an incomplete checkpoint
    (root / "step_final").mkdir()     # no step number in its name
    t = Trainer(compose([*BASE, "steps=6", f"dump_dir={run}", "resume=auto"]))
    assert t.step == 4
    out = capsys.readouterr().out
    assert "skipping" in out and "step_00000009" in out and "meta.json is missing" in out
    assert "step_final" in out and "not a checkpoint name" in out


# ---------------------------------------------------------------- item 5: one run per dump_dir
def test_second_trainer_on_a_busy_dump_dir_is_refused(tmp_path):
    first = Trainer(compose([*BASE, "steps=2", f"dump_dir={tmp_path}"]))
    with pytest.raises(RuntimeError, match=rf"in use by another run \(host {socket.gethostname()}, pid {os.getpid()}"):
        Trainer(compose([*BASE, "steps=2", f"dump_dir={tmp_path}", "seed=1"]))
    assert first.fit()["steps"] == 2
    assert "seed: 0" in (tmp_path / "config.yaml").read_text()
    Trainer(compose([*BASE, "steps=3", f"dump_dir={tmp_path}", "resume=auto"])).fit()  # released by fit


def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path, capsys):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "run.lock").write_text(json.dumps({"host": "gone-host", "pid": 999999, "started": "then"}))
    Trainer(compose([*BASE, "steps=1", f"dump_dir={tmp_path}"])).fit()
    out = capsys.readouterr().out
    assert "taking over the stale lock" in out and "gone-host" in out and "999999" in out
    assert (tmp_path / "run.lock").read_text() == ""  # a clean end leaves no holder behind


@pytest.mark.slow
def test_two_processes_on_one_dump_dir(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "memlm.train", *BASE, f"dump_dir={tmp_path}"]
    first = subprocess.Popen([*cmd, "steps=100000"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in first.stdout:
            if "step 2/" in line:  # the first run is training: it holds the lock
                break
        second = subprocess.run([*cmd, "steps=2", "seed=1"], capture_output=True, text=True, env=env, timeout=300)
        assert second.returncode != 0
        assert f"host {socket.gethostname()}, pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        first.send_signal(signal.SIGUSR1)  # stop the first run cleanly: checkpoint and exit
        rest = first.stdout.read()
        assert first.wait(timeout=300) == 0, rest
    finally:
        first.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["preempted"] is True
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, summary["steps"] + 1))  # the first run's lines only
    assert "seed: 0" in (tmp_path / "config.yaml").read_text()
    verify(tmp_path / "checkpoints" / f"step_{summary['steps']:08d}")


# ---------------------------------------------------------------- item 6: the re-save window
class _Killed(BaseException):
    pass


def test_kill_inside_a_resave_is_recovered(tmp_path, monkeypatch, capsys):
    """A kill between the two renames of a re-save (old copy moved aside, new
    copy not yet in place): readers still load the step, and the next start
    finishes the swap and removes the leftovers."""
    import memlm.checkpoint.checkpointer as ck
    from memlm.run.export import export
    from memlm.run.load import load_model

    run = tmp_path / "run"
    trainer = Trainer(compose([*BASE, "steps=2", f"dump_dir={run}"]))
    trainer.fit()
    root = run / "checkpoints"
    real_replace = os.replace

    def dies_after_moving_the_old_copy(src, dst):
        real_replace(src, dst)
        if Path(dst).name.startswith(".old_"):
            raise _Killed

    monkeypatch.setattr(ck.os, "replace", dies_after_moving_the_old_copy)
    with pytest.raises(_Killed):
        trainer.save_checkpoint()  # step 2 again
    monkeypatch.undo()
    assert not (root / "step_00000002").exists() and (root / ".old_step_00000002").is_dir()
    assert (root / "latest").read_text().strip() == "step_00000002"
    # Readers (export, evals' load_model) recover without a writer.
    export(run, tmp_path / "export")
    assert load_model(run).step == 2
    # The next start repairs the folder; a leftover .old_ copy of a finished re-save goes too.
    Trainer(compose([*BASE, "steps=2", f"dump_dir={run}", "resume=auto"])).close()
    assert "recovered" in capsys.readouterr().out
    assert _names(root) == ["latest", "step_00000002"]
    verify(root / "step_00000002")
    shutil.copytree(root / "step_00000002", root / ".old_step_00000002")
    Trainer(compose([*BASE, "steps=2", f"dump_dir={run}", "resume=auto"])).close()
    assert _names(root) == ["latest", "step_00000002"]


# ---------------------------------------------------------------- item 8: small ones
def test_requeue_of_a_finished_run_keeps_its_summary(tmp_path):
    Trainer(compose([*BASE, "steps=2", f"dump_dir={tmp_path}"])).fit()
    before = json.loads((tmp_path / "summary.json").read_text())
    assert before["final_loss"] is not None
    Trainer(compose([*BASE, "steps=2", f"dump_dir={tmp_path}", "resume=auto"])).fit()
    after = json.loads((tmp_path / "summary.json").read_text())
    assert after["steps"] == 2 and after["final_loss"] == before["final_loss"]


def test_checkpoint_error_names_the_exception_not_dcps_tuple():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from memlm.checkpoint.dcp_calls import dcp_call

    def failing(*args, **kwargs):
        try:
            raise ValueError("shard 3 is unreadable\nsecond line")
        except ValueError as err:
            raise CheckpointException("load failed", {0: _wrap_exception(err)}) from None

    with pytest.raises(CheckpointError) as err:
        dcp_call(failing, {}, checkpoint_id="ckpt/step_00000002")
    assert str(err.value) == "checkpoint ckpt/step_00000002: ValueError: shard 3 is unreadable"


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_export_cli_prints_one_line_for_a_bad_checkpoint(run, tmp_path, capsys, damage):
    from memlm.run.export import main

    ckpt = run / "checkpoints" / "step_00000004"
    if damage == "missing":
        ckpt = run / "checkpoints" / "step_00000099"
    else:
        corrupt_shard(ckpt)
    assert main([str(ckpt), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: cannot export")
    assert ("does not exist" if damage == "missing" else "__0_0.distcp is corrupted") in err
