"""The trainer on one process: accumulation, parameter groups, schedules,
the non-finite guard, bad input, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cli import run_main
from fault_injection import nonfinite_loss_at

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.optim.build import lr_multiplier
from memlm.train.trainer import NonFiniteLossError, Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "optim.warmup=0", "optim.lr=1e-3",
        "logging.wandb.mode=disabled", "checkpoint.at_end=false"]


def _batches(n: int, rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (n, rows, 17), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def test_gradient_accumulation_equals_bigger_micro_batch(tmp_path):
    big = _batches(3, 4)
    ref = Trainer(compose([*BASE, "data.micro_batch=4", f"dump_dir={tmp_path / 'a'}"]), train_loader=iter(big))
    small = [(x[i:i + 2], y[i:i + 2]) for x, y in big for i in (0, 2)]
    acc = Trainer(compose([*BASE, "data.micro_batch=2", "global_batch_tokens=64", f"dump_dir={tmp_path / 'b'}"]),
                  train_loader=iter(small))
    assert acc.accum == 2
    for _ in range(3):
        a, b = ref.train_step(), acc.train_step()
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for (name, p), q in zip(ref.model.named_parameters(), acc.model.parameters()):
        assert (p - q).abs().max().item() <= 1e-5, name


def test_global_batch_not_divisible_fails_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"global_batch_tokens=100.*2 x 16 x 1 = 32"):
        Trainer(compose([*BASE, "data.micro_batch=2", "global_batch_tokens=100", f"dump_dir={tmp_path}"]))


def test_world_size_not_divisible_by_memory_parallel():
    from memlm.distributed.env import DistEnv, build_meshes

    env = DistEnv(rank=0, world_size=3, local_rank=0, local_world_size=3, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"parallel.memory_parallel=2.*world size 3"):
        build_meshes(env, 2, "full")


def test_nonfinite_loss_is_skipped_counted_and_stops(tmp_path):
    t = Trainer(compose([*BASE, "data.micro_batch=2", "max_nonfinite_steps=2", f"dump_dir={tmp_path}"]))
    nonfinite_loss_at(t, {2, 4, 5})
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.train_step()
    after_1 = {k: v.clone() for k, v in t.model.state_dict().items()}
    out = t.train_step()  # step 2: NaN
    assert out["skipped"] == 1.0 and t.nonfinite_total == 1
    assert all(torch.equal(after_1[k], v) for k, v in t.model.state_dict().items())
    assert not all(torch.equal(before[k], after_1[k]) for k in before)
    t.train_step()  # step 3 fine: the run of NaNs resets
    t.train_step()  # step 4 NaN
    with pytest.raises(NonFiniteLossError, match="2 consecutive non-finite losses"):
        t.train_step()  # step 5 NaN -> second in a row
    assert t.nonfinite_total == 3


def test_value_table_gets_its_own_group(tmp_path):
    t = Trainer(compose([*BASE, "model.n_layers=3", "memory=memplus", "memory.n_keys=8", "memory.knn=4",
                         "memory.eval_knn=4", "memory.k_dim=16", "memory.heads=2", "memory.layers=[1]",
                         "memory.value_lr=0.01", "memory.value_weight_decay=0.05", "memory.value_grad_clip=0.3",
                         f"dump_dir={tmp_path}"]))
    groups = {g["name"]: g for g in t.optimizer.param_groups}
    values = groups["memory_values"]
    # The base lr is the value lr; the schedule multiplies it like every group's.
    assert values["initial_lr"] == pytest.approx(0.01) and values["weight_decay"] == 0.05
    assert values["lr"] / values["initial_lr"] == pytest.approx(groups["decay"]["lr"] / groups["decay"]["initial_lr"])
    assert values["max_grad_norm"] == 0.3
    assert [tuple(p.shape) for p in values["params"]] == [(64, 64)]
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in groups["no_decay"]["params"])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_schedules_warm_up_then_reach_their_floor(schedule):
    o = compose([f"optim.schedule={schedule}", "optim.warmup=10", "optim.min_lr_ratio=0.1"]).optim
    f = [lr_multiplier(s, 100, o) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b + 1e-12 for a, b in zip(f[:10], f[1:10]))
    assert f[-1] == pytest.approx(1.0 if schedule == "constant" else 0.1)
    if schedule == "wsd":
        assert f[70] == 1.0 and f[90] < 1.0


def _cli(args, env_extra=None, torchrun=False):
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "memlm.train", *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "memlm.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("torchrun", [False, True], ids=["1proc", "torchrun2"])
@pytest.mark.parametrize("memory", ["none", "memplus"])
def test_cli_trains_and_writes_metrics_and_wandb(tmp_path, torchrun, memory):
    extra = [] if memory == "none" else ["model.n_layers=3", "memory.layers=[1]", "memory.n_keys=16",
                                         "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16", "memory.heads=2"]
    out = _cli(["data=synthetic", "data.synthetic.people=60", f"data.cache_dir={tmp_path / 'cache'}",
                "data.seq_len=32", "data.micro_batch=8", f"memory={memory}",
                *extra, "steps=40", "optim.lr=1e-2", "optim.warmup=5", "logging.every=5",
                "logging.wandb.mode=offline", f"dump_dir={tmp_path}", "name=cli"], torchrun=torchrun)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]
    assert all("tokens_per_s" in r for r in records if "loss" in r)
    if memory != "none":
        last = [r for r in records if "loss" in r][-1]
        assert 0 < last["memory/layer1/usage"] <= 1
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "summary.json").is_file()


def test_cli_reports_bad_config_cleanly(capsys):
    out = run_main("memlm.train", "model.dim=66", capsys=capsys)
    assert out.returncode == 2
    assert "model.dim=66" in out.stderr and "Traceback" not in out.stderr


SPARSE = [*BASE, "model.n_layers=2", "memory=memplus", "memory.layers=[1]", "memory.heads=1",
          "memory.k_dim=16", "memory.value_weight_decay=0.1", "memory.value_grad_clip=0", "optim.clip=0",
          "data.micro_batch=2"]


def _value_table(trainer):
    return trainer.model.shared.memory_values.weight


def test_sparse_updates_touch_only_rows_read(tmp_path):
    t = Trainer(compose([*SPARSE, "memory.sparse_updates=true", "memory.n_keys=16", "memory.knn=2",
                         "memory.eval_knn=2", f"dump_dir={tmp_path}"]), train_loader=iter(_batches(1, 2)))
    table = _value_table(t)
    before = table.detach().clone()
    read = set()
    layer = t.model.layers[1].feed_forward.memory
    hook = layer.lookup.register_forward_hook(lambda m, i, out: read.update(out[1].flatten().tolist()))
    t.train_step()
    hook.remove()
    changed = set((table.detach() != before).any(dim=1).nonzero().flatten().tolist())
    assert changed == read and 0 < len(read) < 256
    state = t.optimizer.state[table]
    moved = set((state["exp_avg"] != 0).any(dim=1).nonzero().flatten().tolist())
    assert moved == read


def test_sparse_updates_equal_dense_adamw_when_every_row_is_read(tmp_path):
    # 4 slots (n_keys 2), 2 reads per token, 32 tokens per step: every row is read
    # at every step (checked below), so lazy AdamW must equal dense AdamW.
    from memlm.memory.usage import usage_metrics

    common = [*SPARSE, "memory.n_keys=2", "memory.knn=2", "memory.eval_knn=2"]
    batches = _batches(3, 2)
    dense = Trainer(compose([*common, f"dump_dir={tmp_path / 'd'}"]), train_loader=iter(batches))
    sparse = Trainer(compose([*common, "memory.sparse_updates=true", f"dump_dir={tmp_path / 's'}"]),
                     train_loader=iter(batches))
    for _ in range(3):
        a, b = dense.train_step(), sparse.train_step()
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert usage_metrics(sparse.model)["memory/layer1/usage"] == 1.0
    assert torch.allclose(_value_table(dense), _value_table(sparse), atol=1e-6, rtol=0)


def test_missing_data_paths_fail_before_training(tmp_path):
    from memlm.data.stats import DataError
    from memlm.data.tokenizer import train_tokenizer

    missing = tmp_path / "nowhere" / "*.jsonl"
    raw = [*BASE, "data.kind=raw", f"data.sources=[{{path: '{missing}'}}]", f"dump_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match="missing.model"):
        Trainer(compose([*raw, f"data.tokenizer={tmp_path / 'missing.model'}"]))
    tok = tmp_path / "tok.model"
    train_tokenizer([f"document number {i} about things" for i in range(200)], str(tok), 300)
    with pytest.raises((ConfigError, DataError, FileNotFoundError)) as err:
        Trainer(compose([*raw, f"data.tokenizer={tok}"]))
    assert "nowhere" in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_step(tmp_path, mode):
    memory = ["model.n_layers=3", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4",
              "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16", "data.micro_batch=2"]
    batches = _batches(2, 2)
    ref = Trainer(compose([*BASE, *memory, f"dump_dir={tmp_path / 'a'}"]), train_loader=iter(batches))
    ac = Trainer(compose([*BASE, *memory, f"parallel.activation_checkpoint={mode}", f"dump_dir={tmp_path / 'b'}"]),
                 train_loader=iter(batches))
    wrapped = [type(m).__name__ for m in ac.model.modules() if "Checkpoint" in type(m).__name__]
    assert wrapped, "no module was wrapped for recomputation"
    for _ in range(2):
        a, b = ref.train_step(), ac.train_step()
        assert a["loss"] == b["loss"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_and_keep_parameter_names(tmp_path):
    batches = _batches(3, 2)
    eager = Trainer(compose([*BASE, "data.micro_batch=2", f"dump_dir={tmp_path / 'e'}"]), train_loader=iter(batches))
    compiled = Trainer(compose([*BASE, "data.micro_batch=2", "parallel.compile=true", f"dump_dir={tmp_path / 'c'}"]),
                       train_loader=iter(batches))
    for _ in range(3):
        a, b = eager.train_step(), compiled.train_step()
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    assert list(eager.model.state_dict()) == list(compiled.model.state_dict())


def test_the_summary_names_the_commit_the_run_started_on(tmp_path, monkeypatch):
    """A checkout that moves while a run trains (a study's queue checking out its next commit, a developer's
    commits) must not be named as the code that ran: the environment is read as the run starts."""
    import memlm.machine as machine

    heads = iter(["a" * 40, "b" * 40])
    real = machine._git
    monkeypatch.setattr(machine, "_git", lambda *args: next(heads) if args[0] == "rev-parse" else real(*args))
    trainer = Trainer(compose([*BASE, "data.micro_batch=2", "steps=1", f"dump_dir={tmp_path}"]),
                      train_loader=iter(_batches(1, 2)))
    machine.run_environment()  # the checkout moves on: HEAD now reads "b" * 40
    trainer.fit()
    assert json.loads((tmp_path / "summary.json").read_text())["environment"]["commit"] == "a" * 40
