"""profile.steps writes a torch.profiler trace of the chosen steps;
logging.tensorboard writes the scalars wandb gets as TensorBoard events."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.train.trainer import Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0",
        "logging.wandb.mode=disabled", "checkpoint.at_end=false", "val_batches=1"]
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def test_profile_steps_write_a_trace_of_those_steps(tmp_path):
    Trainer(compose([*BASE, "steps=4", "profile.steps=[2,3]", f"dump_dir={tmp_path}"])).fit()
    traces = list((tmp_path / "profile").iterdir())
    assert [p.name for p in traces] == ["trace_rank0_steps2-3.json"]  # no CUDA here: no memory snapshot
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("train_step "))
    assert steps == ["train_step 2", "train_step 3"]  # one span per profiled step
    assert any(e.get("name") == "aten::scaled_dot_product_attention" for e in events)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (memory snapshots are CUDA-only)")
def test_cuda_profile_writes_a_memory_snapshot(tmp_path):
    Trainer(compose([*BASE, "device=cuda", "steps=3", "profile.steps=[2,2]", f"dump_dir={tmp_path}"])).fit()
    names = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert names == ["memory_rank0_steps2-2.pickle", "trace_rank0_steps2-2.json"]
    assert (tmp_path / "profile" / names[0]).stat().st_size > 0


def test_no_profile_by_default_and_bad_ranges_fail(tmp_path):
    Trainer(compose([*BASE, "steps=2", f"dump_dir={tmp_path}"])).fit()
    assert not (tmp_path / "profile").exists()
    for steps in ("[3,2]", "[0,1]", "[1,5]", "[2]"):
        with pytest.raises(ConfigError, match="profile.steps"):
            compose([*BASE, "steps=4", f"profile.steps={steps}"])


def test_a_run_ending_inside_the_range_writes_what_it_recorded(tmp_path):
    trainer = Trainer(compose([*BASE, "steps=6", "profile.steps=[2,5]", f"dump_dir={tmp_path}"]))
    trainer.fit(stop_after=3)  # e.g. a time slot that ends at step 3
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["trace_rank0_steps2-3.json"]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install 'memlm[tensorboard]'); "
                                                "test_tensorboard_missing_fails_before_training covers this case")
def test_tensorboard_gets_the_scalars_wandb_gets(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(compose([*BASE, "steps=4", "logging.every=2", "logging.tensorboard=true", f"dump_dir={tmp_path}"])).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # What MetricsLogger sends to wandb: every key but step, at that step.
    want: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for key, value in r.items():
            if key != "step":
                want.setdefault(key, []).append((r["step"], float(value)))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(want)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= set(want)
    for key, points in want.items():
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), key


def test_tensorboard_missing_fails_before_training(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as on a machine without the package
                        lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="logging.tensorboard"):
        Trainer(compose([*BASE, "steps=2", "logging.tensorboard=true", f"dump_dir={tmp_path}"]))
    assert not (tmp_path / "config.yaml").exists()  # failed before anything was written
