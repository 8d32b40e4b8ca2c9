"""UltraMemV2 as a memory family (memory=ultramem; model/ultramem_ffn.py): a layer in every
block beside a reduced SwiGLU, trained, resumed, fine-tuned and exported by the same house as
Memory+, and on two ranks (memory_parallel 1 and 2) as on one process."""

from __future__ import annotations

import pytest
import torch
from equivalence import BASE, assert_ranks_equal_one_process
from family_paths import check_family_paths, sparse_finetune_steps

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.memory.tables import sparse_tables
from memlm.memory.ultramem import UltraMemV2
from memlm.model import build_model
from memlm.model.ultramem_ffn import UltraMemFFN, reduced_hidden

SMALL = ["memory=ultramem", "memory.n_keys=16", "memory.k_dim=32", "memory.knn=8"]
RUN = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "logging.every=1",
       "logging.wandb.mode=disabled", "val_batches=0", *SMALL]


def test_every_block_holds_the_layer_beside_a_reduced_ffn():
    cfg = compose([*RUN, "model.n_layers=3", "memory.ffn_fraction=0.25"])
    model = build_model(cfg.model, cfg.memory)
    ffns = [block.feed_forward for block in model.layers]
    assert all(isinstance(f, UltraMemFFN) and isinstance(f.memory, UltraMemV2) for f in ffns)
    assert {f.ffn.w1.out_features for f in ffns} == {reduced_hidden(cfg.model.hidden_dim, 0.25)}
    tables = {id(p) for p in sparse_tables(model)}
    assert tables == {id(p) for f in ffns for p in (f.memory.values.weight, f.memory.pre_values.weight)}
    bare = compose([*RUN, "memory.ffn_fraction=0"])
    alone = build_model(bare.model, bare.memory)
    assert all(block.feed_forward.ffn is None for block in alone.layers)
    counts = model.num_params()
    unread = sum((f.memory.n_rows - f.memory.lookup.heads * f.memory.lookup.knn) * (f.memory.v_dim + f.memory.pre_dim)
                 for f in ffns)  # the rows of V and P a token does not read
    assert counts["active"] == counts["total"] - unread


@pytest.mark.parametrize("override,key", [("memory.expansion=3", "memory.expansion"),
                                          ("memory.value_dtype=bf16", "memory.value_dtype"),
                                          ("memory.knn=300", "memory.knn"),
                                          ("memory.ffn_fraction=-1", "memory.ffn_fraction")])
def test_bad_settings_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose([*RUN, override])
    assert err.value.key == key


def test_trains_resumes_fine_tunes_and_exports(tmp_path):
    check_family_paths(RUN, tmp_path)  # finetune=memory: V and P alone move


@pytest.mark.slow
@pytest.mark.parametrize("world,memory_parallel", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_ranks_equal_one_process(tmp_path, world, memory_parallel):
    """V and P column-sharded over memory_parallel ranks (replicated over the rest) train as one process."""
    run = [*BASE, *SMALL, "model.n_layers=2"]
    assert_ranks_equal_one_process(run, tmp_path, world, memory_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)])
def test_resharding_restores_model_and_optimizer(tmp_path, saved_on, resumed_on):
    """A checkpoint saved with the tables column-sharded over 2 ranks resumes on 1 process, and back:
    every weight and optimizer state equal."""
    from train_workers import assert_restored_equal, fit_on

    run = [*BASE, *SMALL, "model.n_layers=2", "data.micro_batch=2", "steps=3", f"dump_dir={tmp_path}"]
    saved, resumed = tmp_path / "saved.pt", tmp_path / "resumed.pt"
    # memory_parallel = the ranks: the tables column-sharded over every rank
    fit_on(saved_on, [*run, f"parallel.memory_parallel={saved_on}", "checkpoint.at_end=true"], str(saved))
    # the final checkpoint restored, no step trained
    fit_on(resumed_on, [*run, f"parallel.memory_parallel={resumed_on}", "resume=auto"], str(resumed))
    a = assert_restored_equal(str(saved), str(resumed), step=3)
    assert any("pre_values" in k for k in a["model"])


def test_the_capacity_row_matches_memplus_in_sparse_parameters_and_active_flops():
    """configs/experiment/capacity_ultramem.yaml against capacity_memplus (issue #52's study)."""
    from memlm.model import Transformer

    def measured(experiment: str) -> tuple[int, int]:
        cfg = compose([f"experiment={experiment}"])
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.memory)
        return model.num_params()["memory"], model.flops_per_token(cfg.data.seq_len)

    (ours, our_flops), (theirs, their_flops) = measured("capacity_ultramem"), measured("capacity_memplus")
    assert ours == theirs
    assert abs(our_flops / their_flops - 1) <= 0.05
    # The denser point: the same tables, twice the reads, still within 5% of Memory+'s FLOPs.
    denser, denser_flops = measured("capacity_ultramem_dense")
    assert denser == ours and abs(denser_flops / their_flops - 1) <= 0.05
    reads = {name: compose([f"experiment={name}"]).memory for name in ("capacity_ultramem", "capacity_ultramem_dense")}
    assert reads["capacity_ultramem_dense"].knn == 2 * reads["capacity_ultramem"].knn


def test_built_on_meta_it_reads_the_same_rows():
    """The address map (implicit value expansion) is a buffer: to_empty() leaves garbage in it and
    init_weights() draws it again, so a model built on the meta device (loaders, init=sharded) reads
    the rows the same model built on CPU reads."""
    cfg = compose([*RUN, "memory.expansion=4"])
    on_meta = build_model(cfg.model, cfg.memory)
    from memlm.model import Transformer

    on_cpu = Transformer(cfg.model, cfg.memory)
    for a, b in zip(on_meta.layers, on_cpu.layers):
        assert torch.equal(a.feed_forward.memory.address_rows, b.feed_forward.memory.address_rows)
        assert int(a.feed_forward.memory.address_rows.max()) < a.feed_forward.memory.n_rows


def test_sparse_finetune_moves_only_the_selected_rows_of_v_and_p(tmp_path):
    """finetune=sparse: each step keeps the gradient of the same top_t rows of V and of P (read at the
    same rows); every other tensor stays as the base checkpoint has it."""
    from memlm.train import slot_usage
    from memlm.train.trainer import Trainer

    run = [*RUN, "model.n_layers=2"]
    Trainer(compose([*run, "steps=3", f"dump_dir={tmp_path / 'base'}"])).fit()
    (ckpt,) = (tmp_path / "base" / "checkpoints").glob("step_*")
    assert slot_usage.main([str(ckpt), "--batches", "2"]) == 0
    top_t = 5
    tables = {f"layers.{i}.feed_forward.memory.{t}.weight" for i in range(2) for t in ("values", "pre_values")}
    for moved in sparse_finetune_steps(run, ckpt, top_t, tmp_path / "ft"):
        assert set(moved) == tables, set(moved) ^ tables
        for i in range(2):
            prefix = f"layers.{i}.feed_forward.memory"
            rows_v, rows_p = moved[f"{prefix}.values.weight"], moved[f"{prefix}.pre_values.weight"]
            assert 1 <= len(rows_v | rows_p) <= top_t, (rows_v, rows_p)  # the same rows of both tables


@pytest.mark.slow
@pytest.mark.parametrize("memory_parallel", [1, 2])
def test_sparse_selection_is_the_same_on_two_ranks(tmp_path, memory_parallel):
    """P sharded by rows (FSDP) and V replicated (memory_parallel 1) or column-sharded (2): each rank
    keeps the selected rows it holds, and the run equals one process. SGD with a large lr: a row
    kept on one side and not the other would differ by ~lr x its gradient."""
    from memlm.train import slot_usage
    from memlm.train.trainer import Trainer

    run = [*BASE, *SMALL, "model.n_layers=2"]
    Trainer(compose([*run, "data.micro_batch=4", "steps=2", "checkpoint.at_end=true",
                     f"dump_dir={tmp_path / 'base'}"])).fit()
    (ckpt,) = (tmp_path / "base" / "checkpoints").glob("step_*")
    assert slot_usage.main([str(ckpt), "--batches", "2"]) == 0
    overrides = [*run, "finetune=sparse", "finetune.top_t=6", "finetune.optimizer=sgd", "memory.value_lr=10",
                 f"init_from={ckpt}"]
    assert_ranks_equal_one_process(overrides, tmp_path, 2, memory_parallel)
