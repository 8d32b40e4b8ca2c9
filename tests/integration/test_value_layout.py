"""Value-table layouts (issue 28): `parallel.memory_parallel=auto` takes the
memory_parallel whose value-table traffic takes the least time, by the rule
the planner shows for every layout (memlm.distributed.memory_hooks,
memlm.plan.cost.value_layouts); on 2 and 4 gloo ranks the bytes the
value-gradient exchange sends equal the planner's count and the losses equal
one process's; a run that would all-reduce a large whole table every step is
warned at start-up."""

from __future__ import annotations

import json

import pytest
import torch
from distributed_workers import run_ranks
from equivalence import GLOBAL_BATCH, MEMPLUS, STEPS, assert_same, global_batches, reference_run
from plan_workers import value_grad_traffic

from memlm.config.run import compose
from memlm.distributed.memory_hooks import (
    WHOLE_TABLE_WARNING_BYTES,
    resolve_memory_parallel,
    value_grad_warning,
    value_layouts_of,
    value_tables,
)
from memlm.distributed.value_layout import least_traffic, value_traffic
from memlm.errors import ConfigError
from memlm.model import Transformer
from memlm.plan.planner import model_value_tables, plan

GiB = 2**30
# The case: 8B with 1M slots (n_keys 1024) on 64 GPUs, 8 per node, at the 8b training shape.
EIGHT_B = ["model=8b", "memory=memplus", "memory.n_keys=1024", "data.seq_len=8192", "data.micro_batch=1"]


@pytest.mark.parametrize("memory", [
    ["memory=memplus"],
    ["memory=pk"],
    ["memory=memplus", "memory.share_values=false", "memory.knn=8"],
    ["memory=memplus", "memory.v_dim=256", "memory.value_dtype=bf16", "memory.value_grad_reduce_dtype=bf16"],
    ["memory=memplus", "memory.sparse_updates=true", "memory.layers=[2,5]"],
    ["memory=moe"],
    ["memory=peer"],
    ["memory=ultramem"],
    ["memory=ultramem", "memory.expansion=4", "memory.v_dim=40", "memory.heads=2"],
    ["memory=none"],
    ["memory=engram", "memory.engram.layers=[1,3]"],
    ["memory=memplus", "memory.engram.layers=[0]", "memory.engram.head_dim=32", "memory.sparse_updates=true"],
], ids=lambda m: " ".join(m))
def test_value_tables_from_the_config_equal_the_built_model(memory):
    """The trainer picks the layout before the model exists, from the config;
    the planner reads the built model: both see the same tables and reads."""
    cfg = compose(["model=134m", "memory.n_keys=32", *memory])
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    assert value_tables(cfg) == model_value_tables(model, cfg)
    # one group for a kind with pools, one for the Engram layers' tables
    assert len(value_tables(cfg)) == (cfg.memory.kind in ("memory", "memplus", "ultramem")) + \
        bool(cfg.memory.engram.layers)


def test_auto_takes_the_layout_of_least_traffic():
    cfg = compose([*EIGHT_B, "parallel.memory_parallel=auto"])
    layouts = value_layouts_of(cfg, 64, 8)
    assert [row["memory_parallel"] for row in layouts] == [1, 2, 4, 8, 16, 32, 64]
    # memory_parallel 1: the whole (1M x 4096) fp32 gradient all-reduced over 64 replicas.
    assert layouts[0]["value_grad"] == 2 * 63 * 2**20 * 4096 * 4 // 64  # 31.50 GiB
    best = least_traffic(layouts)
    assert resolve_memory_parallel(cfg, 64, 8) == best["memory_parallel"] == 32
    assert best["value_grad"] == GiB // 2 and best["seconds"] < layouts[0]["seconds"] / 10
    # One rank, no value tables, or an integer given: no choice to make.
    assert resolve_memory_parallel(cfg, 1, 1) == 1
    assert resolve_memory_parallel(compose(["model=8b", "parallel.memory_parallel=auto"]), 64, 8) == 1
    assert resolve_memory_parallel(compose([*EIGHT_B, "parallel.memory_parallel=4"]), 64, 8) == 4


def test_touched_rows_count_what_the_replicas_exchange():
    """Sparse updates: each replica sends its row count, its rows (int64) and
    their gradients, padded to the most rows a replica touched; expected for
    uniform reads when no count is given."""
    values = value_tables(compose([*MEMPLUS, "memory.sparse_updates=true"]))  # 64 rows of 64, 2 reads x 8
    assert value_traffic(values, 1, 2, 32, rows_touched=10)["value_grad"] == 1 * (8 + 10 * (8 + 64 * 4))
    assert value_traffic(values, 2, 4, 32, rows_touched=10)["value_grad"] == 1 * (8 + 10 * (8 + 32 * 4))
    # 2 x 32 tokens x 16 reads of one table: 512 reads of 64 rows touch all but ~0.02 of a row.
    assert value_traffic(values, 1, 2, 32)["value_grad"] == 8 + 64 * (8 + 64 * 4)
    assert value_traffic(values, 2, 2, 32)["value_grad"] == 0  # one replica: nothing to exchange


@pytest.mark.parametrize("value", ["0", "two", "true", "1.5"])
def test_memory_parallel_is_auto_or_a_positive_integer(value):
    with pytest.raises(ConfigError) as err:
        compose([f"parallel.memory_parallel={value}"])
    assert "parallel.memory_parallel" in str(err.value) and "auto or an integer >= 1" in str(err.value)
    assert compose(["parallel.memory_parallel=auto"]).parallel.memory_parallel == "auto"


def test_start_up_warning_for_a_whole_table_all_reduce():
    warning = value_grad_warning(compose([*EIGHT_B, "parallel.memory_parallel=1"]), 64, 8)
    assert warning.startswith("parallel.memory_parallel=1 on 64 ranks all-reduces the whole value-table "
                              "gradient (1 table of 1,048,576 x 4096) every step: 31.50 GiB sent per rank")
    assert "parallel.memory_parallel=32 (what auto takes here) sends 0.50 GiB of value gradients" in warning
    # Sharded by auto, exchanged as touched rows, one rank, or a table too small to matter: no warning.
    assert value_grad_warning(compose([*EIGHT_B, "parallel.memory_parallel=auto"]), 64, 8) is None
    assert value_grad_warning(compose([*EIGHT_B, "parallel.memory_parallel=1", "memory.sparse_updates=true"]),
                              64, 8) is None
    assert value_grad_warning(compose([*EIGHT_B, "parallel.memory_parallel=1"]), 1, 1) is None
    tiny = compose([*MEMPLUS, "parallel.memory_parallel=1"])
    assert value_layouts_of(tiny, 2, 2)[0]["value_grad"] < WHOLE_TABLE_WARNING_BYTES
    assert value_grad_warning(tiny, 2, 2) is None


@pytest.mark.slow  # gloo ranks
@pytest.mark.parametrize("world, memory, setting, memory_parallel", [
    (2, [], "auto", 1),  # 2 ranks: the 64-row table all-reduced over 2 replicas
    (4, [], "auto", 2),  # 4 ranks: memory-parallel pairs, 2 replicas of each column slice
    # 1,024 rows, each replica reads 2 x 16 tokens x 2 layers x 8 slots: touched rows exchanged by 2 replicas
    (2, ["memory.sparse_updates=true", "memory.n_keys=32"], "1", 1),
], ids=["2-auto", "4-auto", "2-touched-rows"])
def test_value_grad_bytes_equal_the_plan_and_losses_one_process(tmp_path, world, memory, setting, memory_parallel):
    batches = global_batches(128)
    ref = reference_run([*MEMPLUS, *memory], batches, tmp_path / "ref")  # one process
    path = tmp_path / "batches.pt"
    torch.save(batches, path)
    overrides = [*MEMPLUS, *memory, f"parallel.memory_parallel={setting}",
                 f"data.micro_batch={GLOBAL_BATCH // world}", f"dump_dir={tmp_path / 'dist'}"]
    run_ranks(value_grad_traffic, world, overrides, str(path), STEPS, str(tmp_path))
    assert_same(ref, torch.load(tmp_path / "dist.pt", weights_only=True))  # losses, norms, weights to 1e-5
    cfg = compose(overrides)
    tokens = cfg.data.micro_batch * cfg.data.seq_len
    for rank in range(world):
        traffic = json.loads((tmp_path / f"traffic{rank}.json").read_text())
        planned = plan(cfg, world, rank)
        assert traffic["memory_parallel"] == planned["memory_parallel"] == memory_parallel
        assert len(traffic["steps"]) == STEPS
        for step in traffic["steps"]:
            assert step.get("memory_all_to_all", 0) == planned["comm_bytes"]["memory_all_to_all"], rank
            if cfg.memory.sparse_updates:  # the planner's count at the rows the replicas touched
                want = value_traffic(value_tables(cfg), memory_parallel, world, tokens,
                                     rows_touched=step["rows_touched"])["value_grad"]
                # Reads cover part of the table: fewer bytes than the whole-table all-reduce.
                assert step["rows_touched"] < value_tables(cfg)[0].rows
                assert want < planned["value_layouts"][0]["value_grad_all_reduce"]
            else:
                want = planned["comm_bytes"]["value_grad_reduce"]
            assert step["value_grad"] == want > 0, (rank, step)
