"""Fine-tuning modes (memlm.finetune): what is frozen stays bitwise
unchanged with no optimizer state, sparse steps change at most top_t rows,
and the selection is the same on one process and on ranks that shard the
table (memory_parallel)."""

from __future__ import annotations

import pytest
import torch
from equivalence import MEMPLUS, assert_same, distributed_run, global_batches, reference_run

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.finetune import background
from memlm.memory.tables import sparse_tables
from memlm.run.load import load_model
from memlm.train import slot_usage
from memlm.train.trainer import Trainer

TINY = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0",
        "logging.wandb.mode=disabled", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4",
        "memory.eval_knn=4", "memory.k_dim=16", "memory.heads=2", "val_batches=0"]
TOP_T = 5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A pretrained tiny Memory+ checkpoint with its background slot usage beside it."""
    run = tmp_path_factory.mktemp("base")
    Trainer(compose([*TINY, "steps=4", f"dump_dir={run}"])).fit()
    (ckpt,) = (run / "checkpoints").glob("step_*")
    assert slot_usage.main([str(ckpt), "--batches", "4"]) == 0
    return ckpt


def _table_names(trainer) -> set[str]:
    tables = {id(p) for p in sparse_tables(trainer.model)}
    return {name for name, p in trainer.model.named_parameters() if id(p) in tables}


def _state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _check_steps(trainer, steps: int, base_state: dict, max_rows: int | None) -> None:
    """Each step: every non-table tensor equals the base checkpoint's, the table moves (at most max_rows rows)."""
    (table,) = _table_names(trainer)
    for _ in range(steps):
        before = _state(trainer)
        trainer.train_step()
        after = _state(trainer)
        for name, value in after.items():
            if name != table:
                assert torch.equal(value, base_state[name]), f"{name} changed"
        rows = int((after[table] != before[table]).any(1).sum())
        assert rows >= 1 and (max_rows is None or rows <= max_rows), rows
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert frozen and all(p not in trainer.optimizer.state for p in frozen)  # no state for frozen weights


@pytest.mark.parametrize("mode,optimizer,lr,ranking", [
    ("memory", "adamw", "1e-2", None), ("sparse", "adamw", "1e-2", None), ("sparse", "sgd", "10", None),
    ("sparse", "sgd", "10", "tfidf_batches")])
def test_only_the_value_table_moves(base, tmp_path, mode, optimizer, lr, ranking):
    base_state = load_model(base).model.state_dict()
    top_t = [f"finetune.top_t={TOP_T}"] if mode == "sparse" else []  # finetune=memory refuses a top_t
    ranked = [f"finetune.ranking={ranking}"] if ranking else []
    trainer = Trainer(compose([*TINY, f"finetune={mode}", f"finetune.optimizer={optimizer}", f"memory.value_lr={lr}",
                               *top_t, *ranked, f"init_from={base}", "steps=3", f"dump_dir={tmp_path}"]))
    try:
        _check_steps(trainer, 3, base_state, TOP_T if mode == "sparse" else None)
    finally:
        trainer.close()


def test_a_resumed_sparse_run_keeps_the_frozen_weights_and_the_row_budget(base, tmp_path):
    base_state = load_model(base).model.state_dict()
    args = [*TINY, "finetune=sparse", f"finetune.top_t={TOP_T}", f"init_from={base}", f"dump_dir={tmp_path}"]
    Trainer(compose([*args, "steps=2"])).fit()
    trainer = Trainer(compose([*args, "steps=4"]))  # resumes at step 2 from its own checkpoint
    try:
        assert trainer.step == 2
        _check_steps(trainer, 2, base_state, TOP_T)
    finally:
        trainer.close()


def test_sparse_without_a_background_file_is_refused_before_the_run_folder(base, tmp_path):
    with pytest.raises(ConfigError, match="finetune.background=.*nothing.safetensors.*slot_usage"):
        Trainer(compose([*TINY, "finetune=sparse", f"finetune.top_t={TOP_T}", f"init_from={base}",
                         f"finetune.background={tmp_path}/nothing.safetensors", f"dump_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_tfidf_batches_ranks_against_the_batches_that_read_each_slot(base, tmp_path):
    documents, n_batches = background.load_batches_read(base / background.FILE, ["layer1"])
    trainer = Trainer(compose([*TINY, "finetune=sparse", f"finetune.top_t={TOP_T}", "finetune.ranking=tfidf_batches",
                               f"init_from={base}", "steps=1", f"dump_dir={tmp_path}"]))
    try:
        (_, names, ranked_against), = trainer.finetune.tables
        assert names == ["layer1"] and n_batches == trainer.finetune.n_batches == 4
        assert torch.equal(ranked_against, documents["layer1"])  # not the background's reads
        assert "top_t 5 by tfidf_batches" in trainer.finetune.describe()
        assert ", 4 background batches of 32 tokens" in trainer.finetune.describe()  # micro_batch 2 x seq_len 16
    finally:
        trainer.close()


def test_a_background_without_batch_counts_is_refused_for_tfidf_batches(base, tmp_path):
    """A slot-usage file written before the batches were counted holds reads only: ranking by batches
    names the file and the command that counts it again, before the run folder."""
    old = tmp_path / "old.safetensors"
    background.save_usage(old, background.load_usage(base / background.FILE, {"layer1": 64}), 128, "an old count")
    with pytest.raises(ConfigError, match=r"finetune.background=.*old.safetensors.*lacks its batch count.*slot_usage"):
        Trainer(compose([*TINY, "finetune=sparse", f"finetune.top_t={TOP_T}", "finetune.ranking=tfidf_batches",
                         f"finetune.background={old}", f"init_from={base}", f"dump_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"this one lacks layer0\+layer2\): count it again"):
        background.load_batches_read(base / background.FILE, ["layer0+layer2"])  # another model's tables


def test_slot_usage_reports_and_refuses_a_dense_model(base, tmp_path, capsys):
    assert slot_usage.main([str(base), "--batches", "2", "--out", str(tmp_path / "u.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "[slot-usage] layer1:" in out and "of 64 slots read" in out
    counts = background.load_usage(tmp_path / "u.safetensors", {"layer1": 64})
    assert int(counts["layer1"].sum()) == 2 * 2 * 16 * 2 * 4  # batches x micro_batch x seq_len x heads x knn
    documents, n_batches = background.load_batches_read(tmp_path / "u.safetensors", ["layer1"])
    assert n_batches == 2 and int(documents["layer1"].max()) <= 2
    assert torch.equal(documents["layer1"] > 0, counts["layer1"] > 0)  # read by some batch: read at all
    dense = tmp_path / "dense"
    Trainer(compose([*TINY[:5], "steps=1", f"dump_dir={dense}"])).fit()
    (ckpt,) = (dense / "checkpoints").glob("step_*")
    assert slot_usage.main([str(ckpt)]) == 2
    assert "product-key memory layers" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("world,memory_parallel", [(2, 2), (4, 2)])
def test_the_selection_is_the_same_on_sharded_ranks(tmp_path, world, memory_parallel):
    """SGD with a large lr: a row selected on one side and not the other would differ by ~lr x its gradient.
    4 ranks with memory_parallel=2 shard the table and replicate it: the counts are summed over both."""
    run = tmp_path / "base"
    Trainer(compose([*MEMPLUS, "data.micro_batch=4", "steps=2", "checkpoint.at_end=true", f"dump_dir={run}"])).fit()
    (ckpt,) = (run / "checkpoints").glob("step_*")
    assert slot_usage.main([str(ckpt), "--batches", "2"]) == 0
    overrides = [*MEMPLUS, "finetune=sparse", "finetune.top_t=6", "finetune.optimizer=sgd", "memory.value_lr=10",
                 f"init_from={ckpt}"]
    batches = global_batches(128)
    ref = reference_run(overrides, batches, tmp_path / "ref")
    got = distributed_run([*overrides, f"parallel.memory_parallel={memory_parallel}"], batches, tmp_path, world)
    assert_same(ref, got)


def test_pretraining_records_its_last_steps_slot_usage_beside_the_final_checkpoint(tmp_path, capsys):
    Trainer(compose([*TINY, "steps=5", "checkpoint.slot_usage_steps=2", f"dump_dir={tmp_path}"])).fit()
    (ckpt,) = (tmp_path / "checkpoints").glob("step_*")
    counts = background.load_usage(ckpt / background.FILE, {"layer1": 64})
    assert int(counts["layer1"].sum()) == 2 * 2 * 16 * 2 * 4  # last 2 steps x micro_batch x seq_len x heads x knn
    documents, n_batches = background.load_batches_read(ckpt / background.FILE, ["layer1"])
    assert n_batches == 2 and torch.equal(documents["layer1"] > 0, counts["layer1"] > 0)
    assert f"slot usage of the last 64 tokens -> {ckpt / background.FILE}" in capsys.readouterr().out
    # a fine-tune finds it in its init_from folder
    trainer = Trainer(compose([*TINY, "finetune=sparse", f"finetune.top_t={TOP_T}", f"init_from={ckpt}", "steps=1",
                              f"dump_dir={tmp_path}/ft"]))
    trainer.close()


def test_lora_trains_only_its_adapters_and_exports_merged_weights(base, tmp_path):
    from memlm.run.export import export

    base_model = load_model(base).model
    base_state = base_model.state_dict()
    run = tmp_path / "lora"
    trainer = Trainer(compose([*TINY, "finetune=lora", "finetune.lora_rank=4", f"init_from={base}", "steps=3",
                               "optim.lr=1e-2", f"dump_dir={run}"]))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # B = 0: the adapted model starts as the base model
        assert torch.equal(trainer.model.eval()(tokens), base_model.eval()(tokens))
    adapters = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora." in n for n in adapters)
    assert all(p.requires_grad == (n in adapters) for n, p in trainer.model.named_parameters())
    trainer.fit()
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert trainer.optimizer.state and all(p not in trainer.optimizer.state for p in frozen)
    state = load_model(run).model.state_dict()
    for name, value in state.items():
        if ".lora." not in name:
            assert torch.equal(value, base_state[name]), f"{name} changed"
    assert any(state[n].abs().sum() > 0 for n in adapters if n.endswith(".lora.b"))  # the adapters learned
    adapted = load_model(run).model
    merged = load_model(export(run, tmp_path / "export")).model
    assert not any(".lora." in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), adapted(tokens), rtol=1e-5, atol=1e-5)
