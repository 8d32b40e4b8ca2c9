"""Faults: non-finite losses and gradients never reach the weights, a checkpoint or an export.

Before: with `optim.lr=1e6` (or a NaN gradient at a finite loss) the step was
applied (the clip's `min(1, max_norm / nan)` is 1), checkpoints and exports
held NaN tensors, and nothing failed.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from distributed_workers import run_ranks
from fault_injection import nan_grad_at
from step_workers import nan_grad_step_on_ranks

from memlm.checkpoint.checkpointer import CheckpointError
from memlm.config.run import compose
from memlm.memory.tables import sparse_tables
from memlm.train.trainer import NonFiniteLossError, Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "data.kind=random",
        "logging.wandb.mode=disabled", "checkpoint.at_end=false", "val_batches=0"]
MEMPLUS = ["memory=memplus", "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16",
           "memory.heads=2", "memory.layers=[1]"]


def _all_finite(model) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values())


def _value_name(trainer) -> str:
    values = {id(p) for p in sparse_tables(trainer.model)}
    return next(n for n, p in trainer.model.named_parameters() if id(p) in values)


def test_lr_1e6_skips_counts_stops_and_saves_only_finite_checkpoints(tmp_path, capsys):
    """The issue's run: tiny Memory+ at optim.lr=1e6 with a checkpoint every 2
    steps and no logging step. Its gradients turn NaN at a finite loss; every
    such step is skipped and counted, the run stops after max_nonfinite_steps
    in a row (found at the next host read: the save of step 6), the weights
    stay finite, and every checkpoint written holds only finite tensors."""
    from memlm.run.load import load_model

    cfg = compose([*BASE, *MEMPLUS, "optim.lr=1e6", "max_nonfinite_steps=3", "steps=20", "logging.every=1000",
                   "checkpoint.every=2", "checkpoint.keep=100", f"dump_dir={tmp_path}"])
    trainer = Trainer(cfg)
    with pytest.raises(NonFiniteLossError, match=r"3 consecutive non-finite"):
        trainer.fit()
    assert trainer.nonfinite_total >= 3
    assert _all_finite(trainer.model)
    out = capsys.readouterr().out
    assert "non-finite gradient norm" in out and "step skipped" in out
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert saved, "the steps before the divergence were checkpointed"
    for path in saved:
        assert _all_finite(load_model(path).model), path


@pytest.mark.parametrize("sparse", [False, True], ids=["adamw", "sparse_row_adamw"])
@pytest.mark.parametrize("where", ["dense", "values"])
def test_nan_gradient_step_is_bitwise_a_no_op(tmp_path, sparse, where):
    """A run whose step 3 has a NaN gradient (finite loss) equals, bitwise, a
    run that never took step 3: weights, AdamW moments and step counts."""
    gen = torch.Generator().manual_seed(0)
    batches = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 128, (4, 2, 17), generator=gen)]
    overrides = [*BASE, *MEMPLUS, "optim.schedule=constant", f"memory.sparse_updates={str(sparse).lower()}"]
    hit = Trainer(compose([*overrides, f"dump_dir={tmp_path / 'a'}"]), train_loader=iter(batches))
    name = _value_name(hit) if where == "values" else "layers.0.attention.wq.weight"
    nan_grad_at(hit, {3: name})
    skip = Trainer(compose([*overrides, f"dump_dir={tmp_path / 'b'}"]),
                   train_loader=iter([batches[0], batches[1], batches[3]]))
    for _ in range(2):
        hit.train_step(), skip.train_step()
    out = hit.train_step()
    assert out["skipped"] == 1.0 and math.isnan(out["grad_norm" if where == "dense" else "value_grad_norm"])
    assert math.isfinite(out["loss"]) and hit.nonfinite_total == 1
    hit.train_step(), skip.train_step()  # both train on batch 4 from the same state
    for (n, p), q in zip(hit.model.named_parameters(), skip.model.parameters()):
        assert torch.equal(p, q), n
        a, b = hit.optimizer.state[p], skip.optimizer.state[q]
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a), n


def test_nan_gradient_step_is_a_no_op_on_two_ranks(tmp_path):
    """FSDP2 DTensor weights and column-sharded values (memory_parallel=2),
    fused AdamW with found_inf on gloo: the NaN-gradient step 2 leaves the
    full weights and optimizer state bitwise as after step 1; a save with one
    non-finite shard on one rank is refused on every rank, naming the tensor."""
    out = tmp_path / "out.pt"
    overrides = [*BASE, *MEMPLUS, "parallel.memory_parallel=2", f"dump_dir={tmp_path}"]
    run_ranks(nan_grad_step_on_ranks, 2, overrides, "layers.1.attention.wo.weight", str(out))
    got = torch.load(out, weights_only=False)
    (model_1, optim_1), (model_2, optim_2) = got["after_1"], got["after_2"]
    assert got["metrics"]["skipped"] == 1.0 and got["nonfinite_total"] == 1
    assert model_1.keys() == model_2.keys() and all(torch.equal(model_1[k], model_2[k]) for k in model_1)
    assert optim_1.keys() == optim_2.keys() and all(torch.equal(optim_1[k], optim_2[k]) for k in optim_1)
    assert all("refusing to write the checkpoint of step 2" in r and "tok_embeddings.weight" in r
               for r in got["refused"]), got["refused"]
    assert not list((tmp_path / "checkpoints").glob("*step_*"))


def _poisoned(tmp_path) -> Trainer:
    trainer = Trainer(compose([*BASE, *MEMPLUS, f"dump_dir={tmp_path}"]))
    trainer.train_step()
    with torch.no_grad():
        trainer.model.output.weight[0, :3] = float("nan")
        trainer.optimizer.state[trainer.model.norm.weight]["exp_avg_sq"][0] = float("inf")
    return trainer


def test_save_refuses_nonfinite_tensors_and_writes_nothing(tmp_path):
    trainer = _poisoned(tmp_path)
    with pytest.raises(CheckpointError) as err:
        trainer.save_checkpoint()
    message = str(err.value)
    assert "refusing to write the checkpoint of step 1" in message
    assert "output.weight (3 non-finite)" in message and "optim.norm.weight.exp_avg_sq (1 non-finite)" in message
    root = tmp_path / "checkpoints"
    assert not root.exists() or list(root.iterdir()) == []


def test_export_refuses_nonfinite_weights_with_one_line(tmp_path, monkeypatch):
    trainer = _poisoned(tmp_path)
    # Write the poisoned checkpoint the way an older memlm (without the save check) did.
    monkeypatch.setattr("memlm.checkpoint.checkpointer.check_finite_state", lambda *a, **k: None)
    checkpoint = trainer.save_checkpoint()
    out_dir = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "memlm.hf.export", str(checkpoint), str(out_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (lines[0].startswith("error: cannot export") and "refusing to write the export of" in lines[0]
            and "output.weight (3 non-finite)" in lines[0])
    assert not out_dir.exists()
