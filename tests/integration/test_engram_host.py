"""Engram's tables in host memory (memory.engram.tables_in=host, memlm.memory.host_tables).

On CPU host and device are one memory, so what tables_in=host changes is the path: each read gathers the
distinct rows it names and hands their row gradient back beside the table. It must train bit for bit as
the tables read whole with row gradients (memory.sparse_updates=true), beside Memory+ too, and resume.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import BASE, global_batches, reference_run
from family_paths import losses

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.memory.host_tables import HostRowsReader, StageRows
from memlm.memory.values import ValuePool
from memlm.plan.planner import plan
from memlm.train.trainer import Trainer

SMALL = ["memory.engram.heads=2", "memory.engram.head_dim=8", "memory.engram.rows_per_head=50"]
ENGRAM = [*BASE, "model.n_layers=2", "memory=engram", "memory.engram.layers=[0,1]", *SMALL,
          "memory.sparse_updates=true"]
BESIDE_MEMPLUS = [*BASE, "model.n_layers=2", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8",
                  "memory.knn=4", "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16",
                  "memory.engram.layers=[0]", *SMALL, "memory.sparse_updates=true"]


@pytest.mark.parametrize("run", [ENGRAM, BESIDE_MEMPLUS, [*ENGRAM, "parallel.activation_checkpoint=full"]],
                         ids=["engram", "beside_memplus", "recomputed"])
def test_host_tables_train_as_the_device_tables(tmp_path, run):
    """Each micro-batch's rows staged from its tokens on the host (the recompute of activation checkpointing
    reads them again unstaged): the run equals the tables read whole on the device, bit for bit."""
    batches = global_batches(128)
    device = reference_run(run, batches, tmp_path / "device")
    host = reference_run([*run, "memory.engram.tables_in=host"], batches, tmp_path / "host")
    assert device["metrics"] == host["metrics"]  # losses and both gradient norms, every step
    assert device["state"].keys() == host["state"].keys()
    for key, value in device["state"].items():
        assert torch.equal(value, host["state"][key]), key


def test_the_host_reader_is_installed_and_reads_the_rows_named(tmp_path):
    trainer = Trainer(compose([*ENGRAM, "memory.engram.tables_in=host", "data.micro_batch=2",
                               f"dump_dir={tmp_path}"]), train_loader=iter(global_batches(128)))
    pools = [b.engram.tables for b in trainer.model.layers]
    assert all(isinstance(p.reader, HostRowsReader) for p in pools)
    stagers = [c for c in trainer.extensions.components if isinstance(c, StageRows)]
    assert len(stagers) == 1 and stagers[0].engrams == [b.engram for b in trainer.model.layers]
    device = Trainer(compose([*ENGRAM, f"dump_dir={tmp_path / 'device'}"]), train_loader=iter(global_batches(128)))
    assert not any(isinstance(c, StageRows) for c in device.extensions.components)  # nothing staged: no stager
    pool = pools[0]
    indices = torch.tensor([[3, 7], [7, 40]])
    weights = torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    out = pool.read(indices, weights)
    table = pool.weight.detach()
    assert torch.equal(out[1], table[7] * 1.0 + table[40] * -1.0)
    out.sum().backward()
    from memlm.memory.sparse_adamw import table_grad

    grad = table_grad(pool.weight).coalesce()
    assert grad.indices()[0].tolist() == [3, 7, 40]
    assert torch.equal(grad.values()[1], torch.full((8,), 2.0 + 1.0))  # row 7: weights 2.0 and 1.0


def test_a_run_on_host_tables_stops_and_resumes_bit_for_bit(tmp_path):
    run = [*ENGRAM[:-1], "memory.sparse_updates=true", "memory.engram.tables_in=host", "model.vocab_size=128",
           "data.micro_batch=2", "logging.every=1", "steps=4"]
    full, halves = tmp_path / "full", tmp_path / "halves"
    Trainer(compose([*run, f"dump_dir={full}"])).fit()
    Trainer(compose([*run, f"dump_dir={halves}"])).fit(stop_after=2)
    Trainer(compose([*run, f"dump_dir={halves}", "resume=auto"])).fit()
    assert len(losses(full)) == 4
    assert losses(halves) == losses(full)


@pytest.mark.parametrize("override,valid", [
    ("memory.sparse_updates=false", "memory.sparse_updates=true"),
    ("parallel.memory_parallel=2", "memory_parallel 1"),
])
def test_host_tables_without_what_they_need_are_refused(override, valid):
    with pytest.raises(ConfigError) as err:
        compose([*ENGRAM, "memory.engram.tables_in=host", override])
    assert err.value.key == "memory.engram.tables_in" and valid in str(err.value)


def test_an_unknown_tables_in_names_the_choices():
    with pytest.raises(ConfigError) as err:
        compose([*ENGRAM, "memory.engram.tables_in=disk"])
    assert err.value.key == "memory.engram.tables_in" and "device, host" in str(err.value)


def test_a_pool_with_a_reader_is_not_also_kept_on_the_host():
    from memlm.memory.host_tables import keep_on_host

    pool = ValuePool(10, 4)
    pool.reader = HostRowsReader()
    with pytest.raises(ValueError, match="exclusive"):
        keep_on_host(pool)


def test_the_pcie_bytes_of_a_step_by_hand():
    from memlm.plan.table_traffic import host_table_bytes

    # Two heads of one row each: 2 tokens read 1 distinct row per head. Per read: 2 rows of 3 floats (24 B)
    # and 2 tokens x 2 heads of positions in them (32 B) to the device, the 2 rows' ids (16 B) and gradients
    # (24 B) back; 2 layers x 3 micro-batches.
    assert host_table_bytes(tokens=2, head_rows=[1, 1], head_dim=3, layers=2, micro_batches=3) == \
        {"to_device": 6 * (24 + 32), "to_host": 6 * 40, "rows": 6 * 2}


def test_the_planner_keeps_host_tables_off_the_device():
    run = ["memory=engram", "memory.sparse_updates=true", "model.n_layers=2", "memory.engram.layers=[0,1]"]
    device = plan(compose(run), world=1)
    host = plan(compose([*run, "memory.engram.tables_in=host"]), world=1)
    held = host["host_tables"]["bytes"]
    tables = device["params_memory"] * 4  # float32 tables
    assert held["params"] == tables
    for key in ("params", "grads", "optimizer"):
        assert device["bytes"][key] - host["bytes"][key] == held[key], key
    assert held["optimizer"] == 2 * tables + 4 * 2  # two moments per table and a step count each
    assert host["host_tables"]["step"]["rows"] > 0 and device["host_tables"] == {"bytes": {}}


def test_the_planner_refuses_host_tables_on_several_gpus():
    with pytest.raises(ConfigError) as err:
        plan(compose(["memory=engram", "memory.sparse_updates=true", "memory.engram.tables_in=host"]), world=2)
    assert err.value.key == "--world"


def test_a_run_on_several_ranks_refuses_host_tables():
    from memlm.distributed.env import DistEnv
    from memlm.run.model import build_run_model, keep_engram_tables_on_host

    model = build_run_model(compose([*ENGRAM, "memory.engram.tables_in=host"]))
    with pytest.raises(ConfigError) as err:
        keep_engram_tables_on_host(model, DistEnv(0, 2, 0, 2, torch.device("cpu")))
    assert err.value.key == "memory.engram.tables_in" and "2 ranks" in str(err.value)


def test_training_reads_the_rows_staged_from_the_tokens_on_the_host(tmp_path, monkeypatch):
    staged_at_read = []
    read = HostRowsReader.__call__

    def spy(self, pool, indices, *args, **kwargs):
        staged_at_read.append(self.staged is not None)
        return read(self, pool, indices, *args, **kwargs)

    monkeypatch.setattr(HostRowsReader, "__call__", spy)
    trainer = Trainer(compose([*ENGRAM, "memory.engram.tables_in=host", "data.micro_batch=2", "global_batch_tokens=64",
                               f"dump_dir={tmp_path}"]), train_loader=iter(global_batches(128) * 2))
    for _ in range(2):
        trainer.train_step()
    assert staged_at_read == [True] * 8  # 2 Engram layers x 2 micro-batches x 2 steps


def test_rows_staged_for_another_batch_are_refused():
    pool = ValuePool(10, 4)
    reader = HostRowsReader()
    reader.stage(pool, torch.tensor([[1, 2, 3]]), "cpu")
    with pytest.raises(ValueError, match=r"shape \(3, 1\).*\(4, 1\)"):
        reader(pool, torch.tensor([[1], [2], [3], [4]]), torch.ones(4, 1), True, "auto")


def test_rows_staged_for_another_micro_batch_of_the_same_shape_are_refused():
    from memlm.memory.host_tables import STALE_STAGE

    pool = ValuePool(10, 4)
    reader = HostRowsReader()
    reader.stage(pool, torch.tensor([[1, 2, 3]]), "cpu")
    with pytest.raises(RuntimeError, match=STALE_STAGE[:40]):
        reader(pool, torch.tensor([[1], [2], [4]]), torch.ones(3, 1), True, "auto")
    reader.stage(pool, torch.tensor([[1, 2, 3]]), "cpu")  # the same rows, read in their staged order
    out = reader(pool, torch.tensor([[1], [2], [3]]), torch.ones(3, 1), True, "auto")
    assert torch.equal(out, pool.weight.detach()[1:4])
