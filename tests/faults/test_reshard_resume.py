"""A resume on another number of ranks continues the same global data stream (issue 21, item 2).

Saved on 2 ranks and resumed on 1 (and 1 -> 2) with the same global batch, the
global batches after the resume are token for token those of an uninterrupted
run, and the losses agree within 1e-3 (the float sums run in another order on
another number of ranks). The global batch of a step is reassembled from the
inputs each rank drew: micro-batch by micro-batch, rank by rank within one
(the loader's global sequence order, docs/data.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed_workers import run_ranks

from faults.reshard_workers import fit_recording
from memlm.data.corpus import Corpus
from memlm.data.loader import PackedBatches, TokenLoader
from memlm.data.stream import TokenSource
from memlm.errors import ConfigError

SEQ, MICRO, GLOBAL_SEQS = 16, 2, 4  # 2 ranks x 2 sequences, or 1 rank x 2 sequences x 2 accumulation steps
STEPS, EVERY = 8, 4
TINY_MEMPLUS = [
    "model.vocab_size=128", f"data.seq_len={SEQ}", f"data.micro_batch={MICRO}",
    f"global_batch_tokens={GLOBAL_SEQS * SEQ}", "optim.warmup=2", "optim.lr=3e-3", "val_batches=0",
    "logging.every=1", "logging.wandb.mode=disabled", f"steps={STEPS}", f"checkpoint.every={EVERY}",
    "model.n_layers=2", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4",
    "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16",
]


def _run(world: int, dump_dir: Path, extra: tuple[str, ...] = ()) -> None:
    overrides = [*TINY_MEMPLUS, f"dump_dir={dump_dir}", *extra]
    if world == 1:
        fit_recording(0, overrides, str(dump_dir))
    else:
        run_ranks(fit_recording, world, overrides, str(dump_dir))


def _global_batches(dump_dir: Path, world: int) -> torch.Tensor:
    """(steps, GLOBAL_SEQS, SEQ): each step's global batch, reassembled from every rank's inputs."""
    accum = GLOBAL_SEQS // (world * MICRO)
    per_rank = [torch.stack(torch.load(dump_dir / f"inputs_rank{r}.pt", weights_only=True)) for r in range(world)]
    micro = torch.stack(per_rank, dim=1)  # (steps * accum, world, MICRO, SEQ)
    return micro.reshape(-1, accum * world * MICRO, SEQ)


def _losses(dump_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, Path]:
    """One uninterrupted run per world size (each also saves the step-EVERY checkpoint resumed below)."""
    runs = {}
    for world in (1, 2):
        runs[world] = tmp_path_factory.mktemp(f"uninterrupted{world}")
        _run(world, runs[world])
    return runs


def test_one_and_two_ranks_see_the_same_global_stream(uninterrupted):
    one, two = _global_batches(uninterrupted[1], 1), _global_batches(uninterrupted[2], 2)
    assert one.shape == (STEPS, GLOBAL_SEQS, SEQ)
    assert torch.equal(one, two)
    a, b = _losses(uninterrupted[1]), _losses(uninterrupted[2])
    assert sorted(a) == list(range(1, STEPS + 1))
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], abs=1e-3)


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size_continues_the_stream(uninterrupted, tmp_path, saved_on, resumed_on):
    # The run saved on `saved_on` ranks, stopped after its step-EVERY checkpoint, restarts on `resumed_on`.
    name = f"step_{EVERY:08d}"
    shutil.copytree(uninterrupted[saved_on] / "checkpoints" / name, tmp_path / "checkpoints" / name)
    _run(resumed_on, tmp_path, ("resume=auto",))
    resumed = _global_batches(tmp_path, resumed_on)
    assert resumed.shape == (STEPS - EVERY, GLOBAL_SEQS, SEQ)
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(EVERY + 1, STEPS + 1))
    for world in (saved_on, resumed_on):  # both uninterrupted runs: same tokens, losses within 1e-3
        assert torch.equal(resumed, _global_batches(uninterrupted[world], world)[EVERY:])
        reference = _losses(uninterrupted[world])
        assert [losses[s] for s in losses] == pytest.approx([reference[s] for s in losses], abs=1e-3)


# ---------------------------------------------------------------- the loader's resharding rule (fast)

def _loader(rank: int, world: int, micro_batch: int) -> TokenLoader:
    # Two sources whose token ids are unique per stream position, so a batch shows where it was read.
    rng = np.random.default_rng(5)
    sources = []
    for k, n_docs in enumerate((30, 12)):
        lens = rng.integers(1, 25, size=n_docs)
        tokens = np.arange(lens.sum(), dtype=np.uint32) + k * 1_000_000
        sources.append(TokenSource(f"s{k}", [(tokens, np.concatenate([[0], np.cumsum(lens)]))], seed=3))
    corpus = Corpus(sources, [0.6, 0.4], vocab_size=2_000_000)
    return TokenLoader(PackedBatches(corpus, 8, micro_batch, rank, world, 3, "train", "test"), corpus, prefetch=0)


def _global(loaders: list[TokenLoader], calls: int) -> np.ndarray:
    """(calls * world * micro_batch, 8) inputs in global order: call by call, rank by rank."""
    return np.concatenate([torch.cat([next(ld)[0] for ld in loaders]).numpy() for _ in range(calls)])


@pytest.mark.parametrize(("old_world", "new_world", "new_micro"), [(2, 1, 4), (1, 2, 2), (2, 4, 1), (4, 2, 3)])
def test_loader_reshard_continues_the_global_stream(old_world, new_world, new_micro):
    old = [_loader(r, old_world, 4 // old_world) for r in range(old_world)]
    _global(old, 7)  # 28 sequences in: past an epoch of the smaller source
    states = [ld.state_dict() for ld in old]
    expected = _global(old, 9)  # 36 more sequences, as the old world reads them
    new = [_loader(r, new_world, new_micro) for r in range(new_world)]
    for loader in new:
        loader.reshard_state_dict(states)
    got = _global(new, 36 // (new_world * new_micro))
    assert np.array_equal(got, expected[:len(got)])
    assert new[0].state_dict()["global_seq"] == 28 + len(got)


def test_loader_reshard_rejects_ranks_that_disagree():
    old = [_loader(r, 2, 2) for r in range(2)]
    _global(old, 3)
    next(old[1])  # rank 1 one batch ahead: not a state of one checkpoint
    with pytest.raises(ConfigError, match="global_seq"):
        _loader(0, 1, 4).reshard_state_dict([ld.state_dict() for ld in old])
    with pytest.raises(ConfigError, match="rank"):  # a missing rank
        _loader(0, 1, 4).reshard_state_dict([old[0].state_dict()])
