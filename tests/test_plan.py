"""The scale planner (memlm.train.plan): its bytes and communication volumes
equal what real gloo ranks hold and send; its CLI and its errors."""

from __future__ import annotations

import json

import pytest
from distributed_workers import run_ranks
from plan_workers import held_bytes

from memlm.train.config import compose
from memlm.train.plan import main, plan

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


def test_cli_fit_and_one_rank(capsys):
    assert main([*SMALL[:-1], "--world", "4", "--fit"]) == 0
    out = capsys.readouterr().out
    assert "memory_parallel that fits on 4 x H200: 1, 2, 4" in out
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
