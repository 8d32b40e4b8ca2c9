"""One process vs several on the same global batches: the runs and the
comparison that tests/integration/test_train_equivalence.py,
test_memory_parallel_scale.py, test_value_layout.py and the memory families' tests share."""

from __future__ import annotations

import pytest
import torch
from distributed_workers import run_ranks
from train_workers import full_state, train_on_slices

from memlm.config.run import compose
from memlm.train.trainer import Trainer

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
# Adam divides by sqrt(v) + eps: for weights whose gradient is ~1e-8, the
# rounding of a differently ordered sum (ranks, all-to-all) changes the update
# by tens of percent. eps=1e-5 keeps those weights out of that regime; the
# pre-clip gradient norms compared below catch any scaling error regardless.
BASE = ["model.vocab_size=128", f"data.seq_len={SEQ}", "optim.warmup=0", "optim.lr=1e-3",
        "optim.eps=1e-5", "logging.wandb.mode=disabled", "optim.clip=0.5", "checkpoint.at_end=false"]


def global_batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference_run(overrides: list[str], batches_, dump_dir) -> dict:
    cfg = compose([*overrides, f"data.micro_batch={GLOBAL_BATCH}", f"dump_dir={dump_dir}"])
    trainer = Trainer(cfg, train_loader=iter(batches_))
    metrics = [trainer.train_step() for _ in range(STEPS)]
    return {"metrics": metrics, "state": full_state(trainer.model)}


def distributed_run(overrides: list[str], batches_, tmp_path, world: int = 2) -> dict:
    path = tmp_path / "batches.pt"
    torch.save(batches_, path)
    out = tmp_path / "dist.pt"
    ranks_overrides = [*overrides, f"data.micro_batch={GLOBAL_BATCH // world}", f"dump_dir={tmp_path / 'dist'}"]
    run_ranks(train_on_slices, world, ranks_overrides, str(path), STEPS, str(out), world)
    return torch.load(out, weights_only=True)


def assert_ranks_equal_one_process(run: list[str], tmp_path, world: int, memory_parallel: int) -> None:
    """`run` on `world` gloo ranks at `memory_parallel` trains as one process on the same global batches."""
    batches = global_batches(128)
    ref = reference_run(run, batches, tmp_path / "ref")
    got = distributed_run([*run, f"parallel.memory_parallel={memory_parallel}"], batches, tmp_path, world=world)
    assert_same(ref, got)


def assert_same(ref: dict, got: dict) -> None:
    # Adam is invariant to the gradient's scale, so equal weights alone would
    # not catch a wrongly scaled gradient: the pre-clip norms must match too.
    for key in ("loss", "grad_norm", "value_grad_norm"):
        want = [m[key] for m in ref["metrics"]]
        assert [m[key] for m in got["metrics"]] == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert ref["state"].keys() == got["state"].keys()
    for name, value in ref["state"].items():
        diff = (value - got["state"][name]).abs().max().item()
        assert diff <= 1e-5, f"{name}: max abs diff {diff}"


MEMPLUS = [*BASE, "model.n_layers=4", "memory=memplus", "memory.layers=[1,3]", "memory.n_keys=8",
           "memory.knn=4", "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16", "memory.value_lr=1e-3"]
