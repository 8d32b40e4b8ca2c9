"""Value tables at scale (issue 22): identical replicas under init=sharded,
the value-gradient reduction started from a hook (and in bf16), sparse value
updates on several ranks, and a column-parallel backward that does not read
the table again."""

from __future__ import annotations

import pytest
import torch
from distributed_workers import run_ranks
from equivalence import MEMPLUS, SEQ, assert_same, distributed_run, global_batches, reference_run
from memory_parallel_workers import column_parallel_read, reduction_paths, sharded_init

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.memory.values import TILE_COLS, TILE_ROWS, seeded_normal_
from memlm.train.trainer import Trainer

# Short runs: a 4-rank gloo test costs seconds per step on a loaded machine.
TINY = [*MEMPLUS, "logging.wandb.mode=disabled"]


def test_seeded_normal_shards_join_into_the_full_table():
    # Shards cut inside a tile and across tile edges, and more than one tile of rows.
    rows, cols = TILE_ROWS + 3, TILE_COLS + 40
    full = seeded_normal_(torch.empty(rows, cols), seed=5, std=0.5)
    for cuts in ([0, 84, cols], [0, TILE_COLS, cols], [0, 1, 100, 150, cols]):
        parts = [seeded_normal_(torch.empty(rows, b - a), 5, 0.5, col_offset=a, full_cols=cols)
                 for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts, dim=1), full)
    assert not torch.equal(seeded_normal_(torch.empty(rows, cols), seed=6, std=0.5), full)
    assert full.std().item() == pytest.approx(0.5, rel=0.02)
    with pytest.raises(ValueError, match=r"columns \[100, 300\).*168 columns"):
        seeded_normal_(torch.empty(2, 200), 5, 0.5, col_offset=100, full_cols=cols)


@pytest.mark.slow  # 4 gloo ranks
def test_sharded_init_replicas_are_bitwise_equal_and_equal_full_init(tmp_path):
    """4 ranks, memory_parallel=2: ranks 0 and 2 hold the same column slice,
    as do 1 and 3. (Before: seeded by seed + rank, so the replicas differed.)"""
    overrides = [*TINY, "parallel.memory_parallel=2", "data.micro_batch=1", f"dump_dir={tmp_path / 'd'}"]
    out = tmp_path / "init.pt"
    run_ranks(sharded_init, 4, overrides, str(out))
    got = torch.load(out, weights_only=True)
    shards = got["shards"]
    assert torch.equal(shards[0], shards[2]) and torch.equal(shards[1], shards[3])
    assert not torch.equal(shards[0], shards[1])
    # init=sharded == init=full on 4 ranks == init=full on one process (any split).
    assert torch.equal(got["sharded"], got["full"])
    assert torch.equal(torch.cat([shards[0], shards[1]], dim=1), got["full"])
    one = Trainer(compose([*TINY, "data.micro_batch=1", f"dump_dir={tmp_path / 'one'}"]), train_loader=iter([]))
    assert torch.equal(one.model.shared.memory_values.weight.detach(), got["full"])


@pytest.mark.slow  # 4 gloo ranks
def test_hybrid_sharded_init_gives_every_replica_the_same_dense_weights(tmp_path):
    """Two "nodes" of 2 ranks, parallel.fsdp=hybrid, init=sharded: ranks 0 and
    2 (and 1 and 3) hold the same shard of every dense weight. (Before: seeded
    seed + rank on CPU, so the two replicas trained different models.)"""
    from train_workers import hybrid_init_shards

    overrides = [*TINY, "parallel.fsdp=hybrid", "parallel.init=sharded", "data.micro_batch=1",
                 f"dump_dir={tmp_path / 'd'}"]
    run_ranks(hybrid_init_shards, 4, overrides, str(tmp_path), per_node=2)
    local = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for name, shard in local[0].items():
        assert torch.equal(shard, local[2][name]) and torch.equal(local[1][name], local[3][name]), name
    assert not torch.equal(local[0]["tok_embeddings.weight"], local[1]["tok_embeddings.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sparse_updates_on_several_ranks_equal_one_process(tmp_path, world):
    """Memory parallel 2 (so 4 ranks = 2 replicas whose rows are merged);
    the 1-process sparse run on the concatenated batch is the reference."""
    sparse = [*TINY, "memory.sparse_updates=true"]
    batches = global_batches(128)
    ref = reference_run(sparse, batches, tmp_path / "ref")
    got = distributed_run([*sparse, "parallel.memory_parallel=2"], batches, tmp_path, world=world)
    assert_same(ref, got)


@pytest.mark.slow
def test_sparse_updates_without_memory_parallel_equal_one_process(tmp_path):
    sparse = [*TINY, "memory.sparse_updates=true"]
    batches = global_batches(128)
    ref = reference_run(sparse, batches, tmp_path / "ref")
    got = distributed_run([*sparse, "parallel.memory_parallel=1"], batches, tmp_path, world=2)
    assert_same(ref, got)


@pytest.mark.slow  # 4 gloo ranks
def test_value_grad_reduction_starts_in_the_hook_and_equals_the_blocking_path(tmp_path):
    """4 ranks, memory_parallel=2 (2 replicas), 2 micro-batches per step."""
    micro = 1
    overrides = [*TINY, "parallel.memory_parallel=2", f"data.micro_batch={micro}",
                 f"global_batch_tokens={2 * micro * SEQ * 4}", f"dump_dir={tmp_path / 'd'}"]
    out = tmp_path / "grads.pt"
    run_ranks(reduction_paths, 4, overrides, str(out))
    got = torch.load(out, weights_only=True)
    assert got["started"] == [0, 1]  # after the first backward: nothing; after the last: started
    assert torch.equal(got["hooked"], got["old"])
    # bf16 on the wire: close to the fp32 sum (bf16 keeps ~3 digits), not equal to it.
    assert not torch.equal(got["hooked_bf16"], got["old"])
    torch.testing.assert_close(got["hooked_bf16"], got["old"], rtol=1e-2, atol=1e-2 * got["old"].abs().max().item())


def test_value_grad_reduce_dtype_is_validated():
    with pytest.raises(ConfigError, match=r"memory.value_grad_reduce_dtype.*fp16.*fp32, bf16"):
        compose([*TINY, "memory.value_grad_reduce_dtype=fp16"])


@pytest.mark.parametrize("sparse", [False, True])
def test_column_parallel_backward_reads_the_table_once(tmp_path, sparse):
    out = tmp_path / "read.pt"
    run_ranks(column_parallel_read, 2, 50, 8, 6, 4, sparse, str(out))
    for r in torch.load(out, weights_only=True):
        assert r["calls"] == 1  # the forward's bag; the backward reuses its graph (before: 2)
        assert r["sparse_grad"] == sparse
        assert r["out_diff"] <= 1e-6 and r["table_grad_diff"] <= 1e-6 and r["weights_grad_diff"] <= 1e-6, r



@pytest.mark.slow
def test_sparse_updates_on_two_ranks_resume_exactly(tmp_path):
    """The lazy optimizer's state of a column-sharded table (DTensor moments
    updated through their local shards) saves and restores like any other."""
    from train_workers import fit_and_dump

    overrides = [*(o for o in TINY if not o.startswith("checkpoint.at_end")), "memory.sparse_updates=true",
                 "parallel.memory_parallel=2", "data.micro_batch=2", "steps=2", f"dump_dir={tmp_path}"]
    saved, resumed = tmp_path / "saved.pt", tmp_path / "resumed.pt"
    run_ranks(fit_and_dump, 2, overrides, str(saved))
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()
    # Same steps, resume=auto: restores the final checkpoint and trains no further.
    run_ranks(fit_and_dump, 2, [*overrides, "resume=auto", "checkpoint.at_end=false"], str(resumed))
    a, b = torch.load(saved, weights_only=True), torch.load(resumed, weights_only=True)
    assert b["step"] == 2 and "shared.memory_values.weight/exp_avg_sq" in a["optim"]
    for part in ("model", "optim"):
        assert a[part].keys() == b[part].keys()
        for k, x in a[part].items():
            assert torch.equal(x, b[part][k]) if isinstance(x, torch.Tensor) else x == b[part][k], f"{part} {k}"


def test_fsdp_shards_a_parameter_smaller_than_the_group_on_its_largest_dim():
    """Product keys (heads, 2, n_keys, k_dim / 2) with 4 heads on 512 ranks:
    Shard(0) would pad dim 0 128x and every all-gather would move the padding."""
    from torch.distributed.tensor import Shard

    from memlm.distributed.parallelize import _shard_placement

    placement = _shard_placement(512)
    assert placement(torch.nn.Parameter(torch.empty(4, 2, 1024, 256, device="meta"))) == Shard(2)
    assert placement(torch.nn.Parameter(torch.empty(4096, 512, device="meta"))) is None  # FSDP's Shard(0)
    assert placement(torch.nn.Parameter(torch.empty(64, device="meta"))) is None
    assert _shard_placement(2)(torch.nn.Parameter(torch.empty(4, 2, 1024, 256, device="meta"))) is None


@pytest.mark.slow  # 4 gloo ranks
def test_keys_sharded_off_dim_0_train_like_one_process(tmp_path):
    """memory.heads=2 on 4 FSDP ranks: the product keys are sharded on n_keys
    (dim 2), not padded on dim 0; training equals the 1-process run."""
    batches = global_batches(128)
    ref = reference_run(TINY, batches, tmp_path / "ref")
    got = distributed_run([*TINY, "parallel.memory_parallel=1"], batches, tmp_path, world=4)
    assert_same(ref, got)
