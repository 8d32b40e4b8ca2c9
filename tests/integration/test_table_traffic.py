"""The value table's traffic per training step stays at its floor
(plan/table_traffic.py): counted on real steps of the trainer, on CPU.

A Memory+ model with 3 layers sharing one 64K-slot pool. By the plain count
(each table-sized tensor an op takes or returns is one pass) the step before
the gradient buffer made 21 passes: backward 6 (each read returned a dense
gradient), the autograd sum 6 (two adds of those), AdamW 4, forward 3, the
clip's norm 1 and its multiply 1. Now: 3 L + 5 = 14, and no op sums or
scales the table's gradient outside the read's backward and the optimizer."""

from __future__ import annotations

import pytest

from memlm.config.run import compose
from memlm.memory.tables import value_pools
from memlm.plan.table_traffic import TablePasses, floor_passes
from memlm.train.trainer import Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "data.kind=random",
        "logging.wandb.mode=disabled", "checkpoint.at_end=false", "val_batches=0", "model.n_layers=3",
        "memory=memplus", "memory.n_keys=256", "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16",
        "memory.heads=2", "memory.layers=[0,1,2]", "steps=4", "memory.value_grad_clip=1e-3"]


@pytest.mark.parametrize("accum", [1, 2])
def test_a_memory_plus_step_stays_at_the_floor(tmp_path, accum):
    batch = ["global_batch_tokens=64"] if accum == 2 else []  # 2 micro-batches of 2 x 16 tokens
    trainer = Trainer(compose([*BASE, *batch, f"dump_dir={tmp_path}"]))
    assert trainer.accum == accum
    (pool,) = value_pools(trainer.model)
    assert tuple(pool.weight.shape) == (65536, 64)
    trainer.train_step(read=False)  # the first step makes the moments
    with TablePasses(tuple(pool.weight.shape)) as passes:
        trainer.train_step(read=False)
    layers = 3
    assert passes.total == floor_passes(layers, accum) == 3 * layers * accum + 5
    assert passes.by_op == {
        "memlm::embedding_bag": layers * accum,               # forward: the table
        "memlm::embedding_bag_accumulate_": 2 * layers * accum,  # backward: the table and the buffer
        "aten::_foreach_norm": 1,                              # the clip's norm (clip 1e-3: it clips)
        "memlm::table_adamw_": 4,                              # p, g, m, v; the clip applied inside
    }


def test_the_counter_sees_an_autograd_sum(tmp_path):
    """Without the buffer (the table's .grad dropped, as torch's zero_grad does),
    every read hands autograd a dense gradient and autograd adds them: the
    counter reports those passes, so the floor test above can fail."""
    trainer = Trainer(compose([*BASE, f"dump_dir={tmp_path}"]))
    (pool,) = value_pools(trainer.model)
    trainer.train_step(read=False)
    pool.weight.grad = None  # no buffer: the reads fall back to autograd's sum
    with TablePasses(tuple(pool.weight.shape)) as passes:
        trainer.train_step(read=False)
    assert passes.by_op["aten::add"] + passes.by_op["aten::add_"] >= 2 * 3 - 2
    assert passes.total > floor_passes(3)


def test_the_scaling_plan_states_the_planners_bytes():
    """docs/scaling-plan.md's 373m fp32 row is what the planner prints."""
    from pathlib import Path

    from memlm.plan.planner import plan, planning_config
    from memlm.plan.report import size_text

    cfg, shape = planning_config(["model=373m", "memory=memplus"])
    t = plan(cfg, 1, shape=shape)["table_step_bytes"]
    row = "| 373m, fp32 | " + " | ".join(size_text(t[k]).split(" (")[0].strip() for k in
                                           ("backward_accumulate", "clip_norm", "optimizer")) + " |"
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scaling-plan.md").read_text()
    assert row in doc
