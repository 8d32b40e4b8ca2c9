"""Engram in the model (memory.engram; model/engram_slot.py): the layers sit before the chosen
blocks' attention beside any memory kind, get their rows once per forward (or computed ahead),
decode with the KV cache as without it, map tokens through the run's tokenizer, and train,
resume bit for bit, fine-tune and export through the same house as the memory families."""

from __future__ import annotations

import pytest
import torch
from equivalence import BASE, assert_ranks_equal_one_process
from evals_fixtures import make_tokenizer
from family_paths import check_family_paths, sparse_finetune_steps

from memlm.config.run import compose
from memlm.data.tokenizer import Tokenizer
from memlm.errors import ConfigError
from memlm.memory.engram import Engram
from memlm.memory.engram_vocab import canonical_map
from memlm.memory.tables import sparse_tables
from memlm.model import Transformer, build_model
from memlm.run.model import build_run_model

SMALL = ["memory.engram.heads=2", "memory.engram.head_dim=8"]
RUN = ["memory=engram", *SMALL, "model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2",
       "optim.warmup=0", "logging.every=1"]
BESIDE_MEMPLUS = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4",
                  "memory.heads=2", "memory.k_dim=16"]


def _model(*overrides: str):
    cfg = compose(["model.vocab_size=97", "model.dim=32", "model.n_layers=3", "model.max_seq_len=32",
                   "data.seq_len=16", *SMALL, *overrides])
    return build_model(cfg.model, cfg.memory, seed=0).eval()


def test_engram_sits_in_the_chosen_blocks_beside_any_memory_kind():
    model = _model("memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.k_dim=16",
                   "memory.knn=4", "memory.eval_knn=4", "memory.engram.layers=[0,2]")
    assert [type(b.engram) for b in model.layers] == [Engram, type(None), Engram]
    assert [b.ffn_kind for b in model.layers] == ["dense", "memplus", "dense"]
    tables = sparse_tables(model)  # Memory+'s pool and both Engram tables: the value group
    assert {id(t) for t in tables} >= {id(model.layers[0].engram.tables.weight),
                                       id(model.layers[2].engram.tables.weight)} and len(tables) == 3
    engram = model.layers[0].engram
    assert engram.hash.multipliers != model.layers[2].engram.hash.multipliers  # per-layer hashing


def test_the_counts_hold_engram():
    with_engram, without = _model("memory=engram"), _model()
    engram = with_engram.layers[1].engram
    table = engram.tables.weight.numel()
    assert with_engram.num_params()["memory"] == table
    assert with_engram.num_params()["active"] - without.num_params()["active"] == \
        sum(p.numel() for p in engram.parameters()) - table + engram.n_heads * engram.head_dim
    # the two projections (E -> dim) and the conv taps, per token
    assert with_engram.flops_per_token(32) - without.flops_per_token(32) == \
        2 * 2 * engram.mem_dim * 32 + 2 * engram.kernel_size * 32


def test_the_planner_counts_engrams_activations():
    from memlm.plan.cost import Layout, activation_bytes

    layout = Layout(world=1, rank=0, gpus_per_node=1, memory_parallel=1, tokens=64, accum=1, seq_len=32,
                    flops_per_token=0, compute_bytes=2, fsdp_size=1, fsdp_replicas=1, fsdp_spans_nodes=False)
    with_engram, without = _model("memory=engram"), _model()
    engram = with_engram.layers[1].engram
    per_token = 8 * engram.n_heads + 2 * (engram.mem_dim + 6 * 32)  # rows, e, six dim-wide tensors
    assert activation_bytes(with_engram, layout, "none")["saved"] - \
        activation_bytes(without, layout, "none")["saved"] == 64 * per_token


def test_rows_computed_ahead_give_the_same_logits():
    model = _model("memory=engram", "memory.engram.layers=[0,2]")
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    rows = model.engram_rows(tokens)
    assert sorted(rows) == [0, 2] and rows[0].shape == (2, 20, 4)
    assert torch.equal(model(tokens, engram_rows=rows), model(tokens))
    with pytest.raises(ValueError, match="engram_rows= with a KV cache is invalid"):
        model(tokens, model.new_cache(batch=2, max_len=24), engram_rows=rows)


def test_decoding_with_the_kv_cache_equals_the_whole_sequence():
    model = _model("memory=engram", "memory.engram.layers=[0,1]")
    with torch.no_grad():
        for block in model.layers:  # the conv starts at zero: give it taps, so its state is used
            block.engram.conv.normal_(generator=torch.Generator().manual_seed(1)) if block.engram else None
    tokens = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    full = model(tokens)
    cache = model.new_cache(batch=3, max_len=24)
    steps = [model(tokens[:, :5], cache), model(tokens[:, 5:8], cache)]
    steps += [model(tokens[:, t:t + 1], cache) for t in range(8, 20)]
    # The attention's and the projections' products over fewer rows round otherwise (the same standard
    # as tests/unit/test_model.py's cache test); the Engram's rows are exact (tests/unit/test_engram.py).
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    cache.reset()
    again = torch.cat([model(tokens[:, t:t + 1], cache) for t in range(20)], dim=1)
    torch.testing.assert_close(again, full, rtol=1e-5, atol=1e-5)


def test_the_token_map_comes_from_the_runs_tokenizer(tmp_path):
    make_tokenizer(tmp_path)
    (tmp_path / "docs.jsonl").write_text('{"text": "x"}\n')  # never read: the model is all this test builds
    run = ["memory=engram", *SMALL, "model.vocab_size=384", "data.kind=raw", f"data.tokenizer={tmp_path / 'tok.model'}",
           f"+data.sources=[{{path: '{tmp_path / 'docs.jsonl'}'}}]"]
    model = build_run_model(compose(run))
    sp = Tokenizer(str(tmp_path / "tok.model")).sp
    want = canonical_map([sp.id_to_piece(i) for i in range(sp.vocab_size())])
    got = model.layers[1].engram.hash.token_map
    assert torch.equal(got, want) and int(want.max()) + 1 < 384  # a real map: some pieces merge
    identity = build_run_model(compose([*run, "memory.engram.token_map=identity"]))
    assert torch.equal(identity.layers[1].engram.hash.token_map, torch.arange(384))


def test_a_model_vocabulary_beyond_the_tokenizers_gets_a_canonical_id_per_extra_token(tmp_path):
    """A padded vocabulary (or a tokenizer that took fewer pieces than asked): the ids past the tokenizer's
    pieces, which no text encodes to, each get a canonical id of their own; fewer ids than pieces is refused."""
    make_tokenizer(tmp_path)
    (tmp_path / "docs.jsonl").write_text('{"text": "x"}\n')
    run = ["memory=engram", *SMALL, "data.kind=raw", f"data.tokenizer={tmp_path / 'tok.model'}",
           f"+data.sources=[{{path: '{tmp_path / 'docs.jsonl'}'}}]"]
    want = build_run_model(compose([*run, "model.vocab_size=384"])).layers[1].engram.hash.token_map
    got = build_run_model(compose([*run, "model.vocab_size=400"])).layers[1].engram.hash.token_map
    assert torch.equal(got[:384], want)
    assert got[384:].tolist() == list(range(int(want.max()) + 1, int(want.max()) + 17))
    with pytest.raises(ConfigError) as err:
        build_run_model(compose([*run, "model.vocab_size=300"]))
    assert err.value.key == "model.vocab_size" and "384" in str(err.value)


@pytest.mark.parametrize("share, n_keys, rows", [(0.25, 111, 4096), (0.5, 91, 8192)])
def test_one_setting_splits_the_sparse_budget(share, n_keys, rows):
    cfg = compose(["experiment=capacity_engram_memplus", f"memory.engram.share={share}"])
    assert (cfg.memory.n_keys, cfg.memory.engram.rows_per_head) == (n_keys, rows)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    pool, engram = model.shared.memory_values.weight, model.layers[1].engram.tables.weight
    asked = 16 * rows * 4 + n_keys**2 * 64  # 16 heads of `rows` rows x head_dim 4, n_keys**2 x v_dim 64
    assert pool.numel() + engram.numel() - asked < 0.01 * 2**20  # the primes add < 1% to the budget of 2**20
    assert abs(asked - 2**20) <= 0.01 * 2**20
    alone = compose(["experiment=capacity_engram"])
    assert (alone.memory.kind, alone.memory.engram.rows_per_head) == ("none", 16384)
    biographies = compose(["experiment=ablation_engram_memplus", f"memory.engram.share={share}"])  # the QA rows
    assert (biographies.memory.n_keys, biographies.memory.engram.rows_per_head) == (n_keys, rows)
    assert compose(["experiment=ablation_engram"]).memory.engram.rows_per_head == 16384


@pytest.mark.parametrize("overrides, key", [
    (["memory.engram.share=1.0"], "memory.engram.share"),  # all to Engram, but Memory+ is there
    (["memory.engram.share=0"], "memory.engram.share"),
    (["memory.engram.share=1.5"], "memory.engram.share"),
])
def test_a_budget_split_that_cannot_hold_is_refused(overrides, key):
    with pytest.raises(ConfigError) as err:
        compose(["experiment=capacity_engram_memplus", *overrides])
    assert err.value.key == key


@pytest.mark.parametrize("override, key", [
    ("memory.engram.layers=[2]", "memory.engram.layers"),
    ("memory.engram.layers=[1,1]", "memory.engram.layers"),
    ("memory.engram.token_map=nfkc", "memory.engram.token_map"),
    ("memory.engram.max_order=1", "memory.engram.max_order"),
    ("memory.engram.rows_per_head=-1", "memory.engram.rows_per_head"),
    ("memory.engram.hash_seed=-1", "memory.engram.hash_seed"),
    ("memory.value_lr=-1", "memory.value_lr"),
    ("parallel.memory_parallel=3", "memory.engram.head_dim"),  # 64 columns do not split 3 ways
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose(["memory=engram", "model.n_layers=2", override])
    assert err.value.key == key


def _base_with_background(run: list[str], dump) -> str:
    """A base run of `run` (2 steps, a final checkpoint) and its background slot usage; the checkpoint."""
    from memlm.train import slot_usage
    from memlm.train.trainer import Trainer

    Trainer(compose([*run, "data.micro_batch=4", "steps=2", "checkpoint.at_end=true", f"dump_dir={dump}"])).fit()
    (ckpt,) = (dump / "checkpoints").glob("step_*")
    assert slot_usage.main([str(ckpt), "--batches", "2"]) == 0
    return str(ckpt)


def test_sparse_fine_tuning_moves_only_the_selected_rows_of_each_table(tmp_path):
    """finetune=sparse beside Memory+: Engram's table and Memory+'s values each keep the gradient of their
    own top_t rows (Engram counts its reads per row under its own name); nothing else moves."""
    run = [*RUN, "model.n_layers=2", *BESIDE_MEMPLUS, "memory.engram.layers=[1]"]
    ckpt = _base_with_background(run, tmp_path / "base")
    top_t = 5
    tables = {"shared.memory_values.weight", "layers.1.engram.tables.weight"}
    for moved in sparse_finetune_steps(run, ckpt, top_t, tmp_path / "ft"):
        assert set(moved) == tables, set(moved) ^ tables
        for key in tables:
            assert 1 <= len(moved[key]) <= top_t, (key, moved[key])


@pytest.mark.slow
@pytest.mark.parametrize("memory_parallel", [1, 2])
def test_sparse_selection_is_the_same_on_two_ranks(tmp_path, memory_parallel):
    """Engram's table replicated (memory_parallel 1) or column-sharded (2): the run equals one process
    (SGD with a large lr: a row kept on one side and not the other would differ by ~lr x its gradient)."""
    run = [*BASE, "model.n_layers=2", "memory=engram", "memory.engram.layers=[0,1]", *SMALL,
           "memory.engram.rows_per_head=50"]
    ckpt = _base_with_background(run, tmp_path / "base")
    overrides = [*run, "finetune=sparse", "finetune.top_t=6", "finetune.optimizer=sgd", "memory.value_lr=10",
                 f"init_from={ckpt}"]
    assert_ranks_equal_one_process(overrides, tmp_path, 2, memory_parallel)


def test_trains_resumes_fine_tunes_and_exports(tmp_path):
    check_family_paths(RUN, tmp_path)  # finetune=memory: the Engram table alone moves


@pytest.mark.slow
@pytest.mark.parametrize("world,memory_parallel,kind", [(2, 2, "memplus"), (4, 2, "memplus"), (4, 4, "memplus"),
                                                        (2, 1, "none"), (2, 2, "sparse")])
def test_ranks_equal_one_process(tmp_path, world, memory_parallel, kind):
    """Engram (alone, or beside Memory+) on 2 and 4 gloo ranks trains as one process: its tables are value
    pools, column-sharded over memory_parallel ranks (head_dim 8 over 4: 2 columns each); with
    memory.sparse_updates they take row gradients."""
    beside = {"memplus": BESIDE_MEMPLUS, "none": ["memory=engram"],
              "sparse": [*BESIDE_MEMPLUS, "memory.sparse_updates=true"]}[kind]
    run = [*BASE, "model.n_layers=2", *beside, "memory.engram.layers=[0,1]", *SMALL,
           "memory.engram.rows_per_head=50"]
    assert_ranks_equal_one_process(run, tmp_path, world, memory_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)])
def test_resharding_restores_model_and_optimizer(tmp_path, saved_on, resumed_on):
    """A checkpoint saved on 2 ranks resumes on 1 process, and back: every weight (the token map
    included) and optimizer state equal."""
    from train_workers import assert_restored_equal, fit_on

    run = [*BASE, *RUN, "model.n_layers=2", "memory.engram.layers=[0,1]", "memory.engram.rows_per_head=50",
           "data.micro_batch=2", "steps=3", f"dump_dir={tmp_path}"]
    saved, resumed = tmp_path / "saved.pt", tmp_path / "resumed.pt"
    fit_on(saved_on, [*run, "checkpoint.at_end=true"], str(saved))
    fit_on(resumed_on, [*run, "resume=auto"], str(resumed))  # the final checkpoint restored, no step trained
    a = assert_restored_equal(str(saved), str(resumed), step=3)
    assert any("engram.tables" in k for k in a["model"]) and any("token_map" in k for k in a["model"])


def test_greedy_decoding_with_the_cache_equals_a_full_recompute():
    from memlm.generation.decoding import decode

    model = _model("memory=engram", "memory.engram.layers=[0,2]")
    with torch.no_grad():
        for block in model.layers:  # taps in the conv, so its decoding state matters
            block.engram.conv.normal_(generator=torch.Generator().manual_seed(3)) if block.engram else None
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 7, 7)]
    cached = decode(model, prompts, 12, -1, use_cache=True)
    assert cached.tokens == decode(model, prompts, 12, -1, use_cache=False).tokens
