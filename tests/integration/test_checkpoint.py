"""Checkpoints: exact resume, kill safety, corruption fallback, resharding, mismatch."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed_workers import run_ranks
from fault_injection import corrupt_shard
from train_workers import fit, full_state

from memlm.checkpoint.checkpointer import CheckpointError, verify
from memlm.checkpoint.folder import seal_meta
from memlm.config.run import compose
from memlm.train.trainer import Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=2",
        "optim.lr=3e-3", "logging.every=1", "logging.wandb.mode=disabled"]


def _losses(dump_dir: Path, key: str = "loss") -> dict[int, float]:
    out = {}
    for line in (dump_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if key in rec:
            out[rec["step"]] = rec[key]
    return out


def _final_weights(dump_dir: Path, overrides: list[str]) -> dict[str, torch.Tensor]:
    cfg = compose([*overrides, f"dump_dir={dump_dir}", "resume=auto", "steps=0"])
    # steps=0 after resume: a trainer that only restores.
    trainer = Trainer(cfg)
    return full_state(trainer.model)


def _run(world: int, overrides: list[str], stop_after: int | None = None) -> None:
    if world == 1:
        Trainer(compose(overrides)).fit(stop_after)
    else:
        run_ranks(fit, world, overrides, stop_after)


@pytest.mark.slow
# The stop after step 6 is a validation step (val_every 3) or not (val_every 4): neither moves the stream.
@pytest.mark.parametrize("world,val_every", [(1, 4), (2, 3)])
def test_exact_resume(tmp_path, world, val_every):
    full, part = tmp_path / "full", tmp_path / "part"
    run = [*BASE, "steps=12", "checkpoint.every=6", f"val_every={val_every}"]
    _run(world, [*run, f"dump_dir={full}"])
    # The interrupted run: stops after step 6, then a second process resumes.
    _run(world, [*run, "checkpoint.at_end=false", f"dump_dir={part}"], 6)
    _run(world, [*run, f"dump_dir={part}", "resume=auto"])
    a, b = _losses(full), _losses(part)
    assert [a[s] for s in range(7, 13)] == [b[s] for s in range(7, 13)]  # bitwise
    # The validation stream goes on where it stopped: later steps read the batches they read unbroken.
    val_a, val_b = _losses(full, "val_loss"), _losses(part, "val_loss")
    assert sorted(val_a) == list(range(val_every, 13, val_every)) and val_a == val_b
    wa = _final_weights(full, BASE)
    wb = _final_weights(part, BASE)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_init_from_loads_weights_only(tmp_path):
    src = tmp_path / "src"
    Trainer(compose([*BASE, "steps=3", f"dump_dir={src}"])).fit()
    ckpt = src / "checkpoints" / "step_00000003"
    t = Trainer(compose([*BASE, "steps=3", f"dump_dir={tmp_path / 'dst'}", f"init_from={ckpt}"]))
    # A fresh optimizer: the state memlm's optimizers make when built (step 0, zero moments), none loaded.
    assert t.step == 0 and all(float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
                               for st in t.optimizer.state.values())
    src_w = _final_weights(src, BASE)
    assert all(torch.equal(src_w[k], v) for k, v in full_state(t.model).items())


def test_init_from_with_resume_auto_starts_fresh_runs_and_continues_started_ones(tmp_path, capsys):
    """A requeued or restarted fine-tune runs the same command line: its own
    newest checkpoint wins over init_from, which only starts a run without one."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    Trainer(compose([*BASE, "steps=3", f"dump_dir={src}"])).fit()
    ckpt = src / "checkpoints" / "step_00000003"
    run = [*BASE, "steps=4", "checkpoint.every=2", f"dump_dir={dst}", f"init_from={ckpt}", "resume=auto"]
    first = Trainer(compose(run))
    assert first.step == 0 and "no checkpoint in" in capsys.readouterr().out
    src_w = _final_weights(src, BASE)
    assert all(torch.equal(src_w[k], v) for k, v in full_state(first.model).items())
    first.fit(stop_after=2)  # preempted after its step-2 checkpoint
    del first
    again = Trainer(compose(run))
    out = capsys.readouterr().out
    assert again.step == 2 and again.optimizer.state and f"init_from={ckpt} is not loaded" in out
    assert not list((dst / "checkpoints").glob("abandoned_*"))  # the run's own history is kept


def test_init_from_with_a_named_checkpoint_is_refused(tmp_path):
    from memlm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"resume='/some/step_2'.*none or auto with init_from=/a/step_1"):
        compose([*BASE, f"dump_dir={tmp_path}", "init_from=/a/step_1", "resume=/some/step_2"])


def test_corrupted_newest_checkpoint_falls_back(tmp_path, capsys):
    Trainer(compose([*BASE, "steps=4", "checkpoint.every=2", f"dump_dir={tmp_path}"])).fit()
    newest = tmp_path / "checkpoints" / "step_00000004"
    corrupt_shard(newest)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupted"):
        Trainer(compose([*BASE, "steps=6", f"dump_dir={tmp_path}", f"resume={newest}"]))
    t = Trainer(compose([*BASE, "steps=6", f"dump_dir={tmp_path}", "resume=auto"]))
    assert t.step == 2
    out = capsys.readouterr().out
    assert "skipping" in out and "step_00000004" in out


def test_truncated_shard_is_named(tmp_path):
    Trainer(compose([*BASE, "steps=2", f"dump_dir={tmp_path}"])).fit()
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    shard = next(ckpt.glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        verify(ckpt)


def test_mismatched_config_lists_tensors(tmp_path):
    Trainer(compose([*BASE, "steps=1", f"dump_dir={tmp_path}"])).fit()
    with pytest.raises(CheckpointError) as err:
        Trainer(compose([*BASE, "model.dim=32", "steps=2", f"dump_dir={tmp_path}", "resume=auto"]))
    message = str(err.value)
    assert "tok_embeddings.weight" in message and "(128, 64)" in message and "(128, 32)" in message


def test_crafted_pickle_in_a_checkpoint_is_refused(tmp_path):
    """A shard replaced by a malicious pickle (with a manifest that matches it,
    as an attacker would write) fails to load without running its payload."""
    import zlib

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    Trainer(compose([*BASE, "steps=2", f"dump_dir={tmp_path / 'run'}"])).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    shard = next(ckpt.glob("__0_*.distcp"))
    payload = pickle.dumps(Evil())
    shard.write_bytes(payload * (shard.stat().st_size // len(payload) + 1))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["manifest"][shard.name] = {"size": shard.stat().st_size, "crc32": zlib.crc32(shard.read_bytes())}
    (ckpt / "meta.json").write_text(json.dumps(seal_meta(meta)))  # meta's own crc32 too
    with pytest.raises(CheckpointError, match="UnpicklingError"):
        Trainer(compose([*BASE, "steps=4", f"dump_dir={tmp_path / 'run'}", f"resume={ckpt}"]))
    assert not (tmp_path / "pwned").exists()
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # what our loaders use for any torch file
    assert not (tmp_path / "pwned").exists()


KILL_SCRIPT = """
import sys, time
import memlm.checkpoint.checkpointer as ck
from memlm.config.run import compose
from memlm.train.trainer import Trainer
real = ck.dcp.save
def slow_save(*a, **k):
    out = real(*a, **k)
    if "step_00000004" in str(k.get("checkpoint_id")):
        print("SAVING", flush=True)
        time.sleep(60)  # killed here: shards written, not yet renamed
    return out
ck.dcp.save = slow_save
Trainer(compose(sys.argv[1:])).fit()
"""


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    overrides = [*BASE, "steps=6", "checkpoint.every=2", f"dump_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, *overrides], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    for line in proc.stdout:
        if "SAVING" in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    root = tmp_path / "checkpoints"
    assert (root / ".tmp_step_00000004").is_dir() and not (root / "step_00000004").exists()
    assert (root / "latest").read_text().strip() == "step_00000002"
    t = Trainer(compose([*BASE, "steps=6", f"dump_dir={tmp_path}", "resume=auto"]))
    assert t.step == 2
    t.fit()
    assert (root / "step_00000006" / "meta.json").is_file()
    assert not (root / ".tmp_step_00000004").exists()  # the next save removed the interrupted one


@pytest.mark.slow
@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)])
def test_resharding_restores_model_and_optimizer(tmp_path, saved_on, resumed_on):
    from train_workers import assert_restored_equal, fit_on

    overrides = [*BASE, "steps=3", f"dump_dir={tmp_path}"]
    saved, resumed = tmp_path / "saved.pt", tmp_path / "resumed.pt"
    fit_on(saved_on, overrides, str(saved))
    # Same steps, resume=auto: the second run restores the final checkpoint and trains no further.
    fit_on(resumed_on, [*overrides, "resume=auto", "checkpoint.at_end=false"], str(resumed))
    assert_restored_equal(str(saved), str(resumed), step=3)


@pytest.mark.slow
def test_sigusr1_checkpoints_and_stops_then_resume_finishes(tmp_path):
    overrides = [*BASE, "steps=100000", f"dump_dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "memlm.train", *overrides], stdout=subprocess.PIPE,
                            text=True, env=env)
    for line in proc.stdout:
        if "step 3/" in line:
            proc.send_signal(signal.SIGUSR1)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=300) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["preempted"] is True and "preempted" in rest
    stopped = summary["steps"]
    assert 3 <= stopped < 100000
    assert (tmp_path / "checkpoints" / f"step_{stopped:08d}" / "meta.json").is_file()
    t = Trainer(compose([*BASE, f"steps={stopped + 2}", f"dump_dir={tmp_path}", "resume=auto"]))
    assert t.step == stopped
    assert t.fit()["steps"] == stopped + 2


def test_async_save_lands_and_resumes_exactly(tmp_path):
    sync, background = tmp_path / "sync", tmp_path / "async"
    Trainer(compose([*BASE, "steps=6", "checkpoint.every=2", f"dump_dir={sync}"])).fit()
    t = Trainer(compose([*BASE, "steps=6", "checkpoint.every=2", "checkpoint.async_save=true",
                         f"dump_dir={background}"]))
    t.fit()
    names = sorted(p.name for p in (background / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004", "step_00000006"]  # keep=2, all published
    for step in (4, 6):
        verify(background / "checkpoints" / f"step_{step:08d}")
    a = Trainer(compose([*BASE, "steps=6", f"dump_dir={sync}", "resume=auto"]))
    b = Trainer(compose([*BASE, "steps=6", f"dump_dir={background}", "resume=auto"]))
    assert a.step == b.step == 6
    sa, sb = full_state(a.model), full_state(b.model)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
