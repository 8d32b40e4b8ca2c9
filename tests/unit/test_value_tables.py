"""One definition of the sparse tables (memlm.memory.tables): the optimizer's
value group, the trainer's clip, the parameter counts, FSDP's ignored
parameters and the planner all see the same tensors, for Memory, Memory+
and PEER alike."""

from __future__ import annotations

import pytest

from memlm.config.run import compose
from memlm.distributed.parallelize import _is_memory_block
from memlm.memory.tables import sparse_tables, split_params, table_modules, value_pools
from memlm.plan.planner import plan
from memlm.train.trainer import Trainer

SMALL = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "logging.wandb.mode=disabled",
         "checkpoint.at_end=false", "memory.layers=[1]"]
KINDS = {
    "memory": ["memory=pk", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4"],
    "memplus": ["memory=memplus", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4"],
    "peer": ["memory=peer", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4"],
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_user_sees_the_same_tables(tmp_path, kind):
    trainer = Trainer(compose([*SMALL, *KINDS[kind], "steps=1", f"dump_dir={tmp_path}"]))
    model = trainer.model
    tables = sparse_tables(model)
    ids = {id(p) for p in tables}
    assert tables and len(ids) == len(tables)

    # the optimizer: exactly the tables in the value group, at memory.value_lr
    (group,) = [g for g in trainer.optimizer.param_groups if g["name"] == "memory_values"]
    assert {id(p) for p in group["params"]} == ids and group["initial_lr"] == trainer.cfg.memory.value_lr
    others = {id(p) for g in trainer.optimizer.param_groups if g["name"] != "memory_values" for p in g["params"]}
    assert not others & ids

    # the clip: the split the trainer took at set-up
    dense, clipped = trainer.params
    assert [id(p) for p in clipped] == [id(p) for p in tables]
    assert {id(p) for p in dense} == {id(p) for p in model.parameters()} - ids
    assert split_params(model)[1] == tables

    # the counts, and the planner's (built again on the meta device)
    counts = model.num_params()
    assert counts["memory"] == sum(p.numel() for p in tables)
    planned = plan(compose([*SMALL, *KINDS[kind], f"dump_dir={tmp_path / 'plan'}"]), 2, 0)
    assert planned["params_memory"] == counts["memory"] and planned["params_total"] == counts["total"]

    # sharding: value pools are the tables read through a pool (memory parallelism, outside FSDP);
    # PEER's expert tables are not, and stay in their block's FSDP unit
    pools = value_pools(model)
    assert all(m in table_modules(model) for m in pools)
    if kind == "peer":
        assert not pools and planned["slots"] == 0 and planned["bytes"]["value_tables"] == 0
    else:
        assert [p for m in pools for p in m.parameters(recurse=False)] == tables
        assert planned["slots"] == pools[0].weight.shape[0]
    assert [_is_memory_block(b) for b in model.layers] == [False, True]
