"""The scale planner (memlm.plan.planner): its bytes and communication volumes
equal what real gloo ranks hold and send; the training shape it plans a
preset at; its CLI, the --fit table and its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from distributed_workers import run_ranks
from plan_workers import held_bytes

from memlm.config.run import compose, group_options
from memlm.plan.cli import main
from memlm.plan.planner import TRAINING_SHAPES, plan, planning_config
from memlm.plan.report import format_plan

# Vocabulary 509: the embedding and output rows do not split evenly over 4
# ranks, so ranks hold different FSDP shards (and FSDP pads its collectives).
TINY = ["model.vocab_size=509", "model.n_layers=4", "memory=memplus", "memory.layers=[1,3]", "memory.n_keys=8",
        "memory.knn=4", "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16", "data.seq_len=16",
        "data.micro_batch=2", "parallel.memory_parallel=2", "parallel.dtype=fp32", "logging.wandb.mode=disabled",
        "checkpoint.at_end=false"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_planner_bytes_equal_a_real_run(tmp_path, world):
    overrides = [*TINY, f"dump_dir={tmp_path / 'run'}"]
    run_ranks(held_bytes, world, overrides, str(tmp_path))
    cfg = compose(overrides)
    for rank in range(world):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        planned = plan(cfg, world, rank)
        for key in ("params", "grads", "optimizer"):
            assert planned["bytes"][key] == real[key], (rank, key)
        # Every collective the step issued, by kind (the loss's scalar
        # all-reduce is not planned), equals the planned volume.
        sent = {k: v for k, v in real["comm"].items() if k != "scalar_all_reduce"}
        expected = {k: v for k, v in planned["comm_bytes"].items() if v}
        assert sent == expected, rank
    if world == 4:  # two replicas of each column slice: the value gradient is reduced
        assert expected["value_grad_reduce"] > 0


SMALL = ["model=tiny", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4",
         "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16", "parallel.memory_parallel=2"]


def test_cli_prints_the_plan(capsys):
    assert main([*SMALL, "--world", "8", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    planned = plan(compose(SMALL), 8, 0, "H100")
    assert f"({planned['bytes']['params']:,} B)" in out
    assert f"({planned['bytes']['optimizer']:,} B)" in out
    for kind in ("fsdp_all_gather", "fsdp_reduce_scatter", "memory_all_to_all", "value_grad_reduce", "MFU"):
        assert kind in out
    assert "8 x H100, memory_parallel 2" in out
    # More memory-parallel ranks: a smaller slice of the value table per rank.
    wider = plan(compose([*SMALL[:-1], "parallel.memory_parallel=8"]), 8, 0, "H100")
    assert wider["bytes"]["value_tables"] * 4 == planned["bytes"]["value_tables"]


def _fit_table(out: str) -> tuple[list[list[str]], str]:
    """The rows of the --fit table (the lines after its header) and the last line."""
    lines = out.rstrip("\n").splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["memory_parallel", "fsdp"])
    return [line.split() for line in lines[header + 1:-1]], lines[-1]


def test_cli_fit_ends_with_one_table_fastest_first(capsys):
    # 8 ranks, 4 per node: memory_parallel 1..8, each with full and hybrid sharding.
    args = [*SMALL[:-1], "--world", "8", "--gpus-per-node", "4", "--fit"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per rank, read from the sharded tensors" not in out  # no per-layout blocks without --verbose
    rows, last = _fit_table(out)
    layouts = [(int(r[0]), r[1], r[2]) for r in rows]
    assert sorted(layouts) == [(p, mode, "none") for p in (1, 2, 4, 8) for mode in ("full", "hybrid")]
    steps = [float(r[4]) for r in rows]
    assert steps == sorted(steps)
    best = rows[0]
    assert last.startswith(f"use: memory_parallel {best[0]}, fsdp {best[1]}, activation_checkpoint none")
    assert last.endswith(f"add parallel.memory_parallel={best[0]} parallel.fsdp={best[1]} "
                         "parallel.activation_checkpoint=none data.seq_len=128 data.micro_batch=8")
    # The same layouts as JSON; the fastest one is the table's first row.
    assert main([*args, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert len(plans) == len(rows) and all(p["fits"] for p in plans)
    fastest = min(plans, key=lambda p: p["time"]["step_s"])
    assert (fastest["memory_parallel"], fastest["fsdp"]) == (int(best[0]), best[1])
    assert main([*args, "--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert verbose.count("per rank, read from the sharded tensors") == len(rows)
    assert _fit_table(verbose) == (rows, last)


def test_cli_fit_takes_the_least_checkpointing_that_fits(capsys):
    # 8B at its 8,192 x 1 shape on 8 H100s: 73.8 GiB per GPU without activation
    # checkpointing, over the 67 GiB usable; recomputing every other block fits.
    # No memory layers: memory_parallel 1 only.
    assert main(["model=8b", "--world", "8", "--gpu", "H100", "--fit", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [(p["memory_parallel"], p["activation_checkpoint"], p["fits"]) for p in plans] == [
        (1, "none", False), (1, "selective", True)]
    assert main(["model=8b", "--world", "8", "--gpu", "H100", "--fit", "parallel.activation_checkpoint=full"]) == 0
    rows, last = _fit_table(capsys.readouterr().out)  # an override pins the knob
    assert [r[:3] for r in rows] == [["1", "full", "full"]]
    assert last.endswith("parallel.activation_checkpoint=full data.seq_len=8192 data.micro_batch=1")


def test_cli_fit_says_when_nothing_fits(capsys):
    # 64M slots of 2,048 fp32 values on one GPU: 512 GiB of table.
    assert main(["model=1b", "memory=memplus", "memory.n_keys=8192", "--world", "1", "--fit"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == ("does not fit at any activation_checkpoint tried (none/selective/full): "
                         "fsdp full with memory_parallel 1")
    assert lines[-1].startswith("nothing fits on 1 x H200: the smallest is ")


# Issue 28: 8B with 1M slots on 64 GPUs. At memory_parallel 1 every rank
# all-reduced the whole 16 GiB value-table gradient, 31.50 GiB per step.
EIGHT_B_1M = ["model=8b", "memory=memplus", "memory.n_keys=1024", "--world", "64"]  # the default layout


def test_8b_with_1m_slots_on_64_gpus_shows_each_value_layout(capsys):
    assert main([*EIGHT_B_1M, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)[0]
    assert (p["memory_parallel_setting"], p["memory_parallel"]) == ("auto", 32)
    assert p["comm_bytes"]["value_grad_reduce"] == 2**29 < 4 * 2**30  # 0.50 GiB per rank per step
    layouts = {row["memory_parallel"]: row for row in p["value_layouts"]}
    assert sorted(layouts) == [1, 2, 4, 8, 16, 32, 64]
    assert layouts[1]["value_grad"] == 33_822_867_456  # the whole table: 31.50 GiB
    # The row auto took is this plan's own count, and the least of them.
    assert layouts[32]["value_grad"] == p["comm_bytes"]["value_grad_reduce"]
    assert layouts[32]["memory_all_to_all"] == p["comm_bytes"]["memory_all_to_all"]
    assert min(layouts.values(), key=lambda row: row["seconds"]) is layouts[32]
    text = format_plan(p)
    assert ", memory_parallel 32 (auto), " in text.splitlines()[0]
    rows = {line.split()[0]: line for line in text.splitlines()[-9:-1]}
    assert rows["1"].split()[4:6] == ["31.50", "GiB"]  # value-grad all-reduce at memory_parallel 1
    assert rows["32"].endswith("<- this plan, auto") and "512.00 MiB" in rows["32"]
    assert text.splitlines()[-1].endswith("512.00 MiB per step; parallel.memory_parallel=auto (the default) "
                                          "takes 32")


def test_8b_preset_plans_at_its_training_shape(capsys):
    assert main(["model=8b", "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert ("shape: seq_len 8,192 x micro_batch 1 per GPU, both from the 8b preset's training shape "
            "in TRAINING_SHAPES (memlm/plan/planner.py)") in out
    assert "train at this shape with data.seq_len=8192 data.micro_batch=1" in out
    assert "65,536 tokens/step" in out  # 8 GPUs x 8,192 tokens
    # At the data config's 128 x 4 tokens the estimate was 14.7% (0.9% with
    # memory=memplus on 64 GPUs); at 8,192 the matmuls dominate the step.
    mfu = float(re.search(r"MFU ([0-9.]+)%", out).group(1))
    assert mfu > 30


def test_every_model_preset_has_a_training_shape_it_can_run():
    for name in group_options("model"):
        cfg, shape = planning_config([f"model={name}"])
        seq_len, micro_batch, why = TRAINING_SHAPES[name]
        assert (cfg.data.seq_len, cfg.data.micro_batch) == (seq_len, micro_batch)
        assert seq_len <= cfg.model.max_seq_len
        assert shape["from"]["seq_len"].endswith(why) and shape["train_with"] == [
            f"data.seq_len={seq_len}", f"data.micro_batch={micro_batch}"]


def test_docs_list_the_training_shapes():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scaling-plan.md").read_text()
    rows = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^\| (\w+) \| (\d+) \| (\d+) \|", doc, re.M)}
    assert rows == {name: shape[:2] for name, shape in TRAINING_SHAPES.items()}


@pytest.mark.parametrize("overrides, seq_len, micro_batch, seq_from, batch_from", [
    (["model=8b", "data.seq_len=4096"], 4096, 1, "your override data.seq_len=4096", "the 8b preset's"),
    (["model=8b", "data.micro_batch=2", "++data.seq_len=2048"], 2048, 2, "your override ++data.seq_len=2048",
     "your override data.micro_batch=2"),
    (["model=8b", "model.max_seq_len=2048"], 2048, 1, "the 8b preset's training shape in TRAINING_SHAPES "
     "(memlm/plan/planner.py), 8192, capped at model.max_seq_len=2048", "the 8b preset's"),
    (["model=tiny", "data=synthetic"], 128, 8, "the tiny preset's", "the tiny preset's"),  # a data preset is no shape
    (["experiment=capacity_memplus"], 128, 32, "set by experiment=capacity_memplus",
     "set by experiment=capacity_memplus"),
    (["model.name=mine"], 128, 4, "configs/data/random.yaml: no training shape for model 'mine'",
     "configs/data/random.yaml"),
])
def test_an_explicit_shape_wins(overrides, seq_len, micro_batch, seq_from, batch_from):
    cfg, shape = planning_config(overrides)
    assert (cfg.data.seq_len, cfg.data.micro_batch) == (shape["seq_len"], shape["micro_batch"]) == (seq_len,
                                                                                                    micro_batch)
    assert shape["from"]["seq_len"].startswith(seq_from)
    assert shape["from"]["micro_batch"].startswith(batch_from)


def test_cli_prints_where_the_shape_came_from(capsys):
    assert main(["model=tiny", "data.seq_len=64", "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert ("shape: seq_len 64 x micro_batch 8 per GPU, seq_len from your override data.seq_len=64; "
            "micro_batch from the tiny preset's training shape") in out
    assert "train at this shape with data.micro_batch=8)" in out
    assert "1,024 tokens/step" in out


def test_cli_one_rank_json(capsys):
    assert main([*SMALL[:-1], "--world", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)[0]
    assert one["comm_bytes"]["fsdp_all_gather"] == 0 and one["bytes"]["optimizer"] > 0


@pytest.mark.parametrize("args, named, valid", [
    (["--world", "0"], "--world=0", "an integer >= 1"),
    (["--world", "6", "parallel.memory_parallel=4"], "parallel.memory_parallel=4", "one of 1, 2, 3, 6"),
    (["--world", "8", "--gpu", "A100"], "--gpu='A100'", "one of: H100, H200"),
    (["--world", "8", "--rank", "8"], "--rank=8", "[0, 7]"),
])
def test_invalid_arguments_name_the_value(capsys, args, named, valid):
    assert main([*SMALL[:-1], *args]) == 2
    err = capsys.readouterr().err
    assert named in err and valid in err


def _saved_for_backward(cfg) -> int:
    """Bytes autograd keeps for backward in one fp32 forward + loss (storages
    counted once, parameters excluded): the reference for the estimate."""
    import torch
    import torch.nn.functional as F

    from memlm.model import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.memory)
    model.init_weights()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.micro_batch, cfg.data.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
    return sum(saved.values())


@pytest.mark.parametrize("memory", [[], ["memory=memplus", "memory.layers=[1,3]", "memory.n_keys=32", "memory.knn=8",
                                         "memory.eval_knn=8", "memory.heads=2", "memory.k_dim=32"]])
def test_activation_estimate_is_close_to_what_autograd_saves(memory):
    cfg = compose(["model.dim=256", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4", "data.seq_len=256",
                   "data.micro_batch=2", "parallel.dtype=fp32", *memory])
    estimate = plan(cfg, 1)["bytes"]["activations"]["saved"]
    assert estimate == pytest.approx(_saved_for_backward(cfg), rel=0.15)
