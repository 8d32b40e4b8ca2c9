"""Loader: exact resume (1 and 2 ranks, 2-source mixture, across epochs), disjoint ranks, one epoch
covers every token once, mixture proportions, world-size change, epoch reshuffling.

Token ids are unique per position (source k holds ids k * 1e6 + i), so a batch tells exactly which
stream positions it came from.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from memlm.data.corpus import Corpus
from memlm.data.loader import PackedBatches, TokenLoader
from memlm.data.stream import TokenSource
from memlm.errors import ConfigError

SOURCE_STRIDE = 1_000_000


def _corpus(doc_counts=(40, 15), weights=(0.7, 0.3), seed=0, shuffle=True, n_shards=2) -> Corpus:
    rng = np.random.default_rng(123)  # fixed layout; `seed` drives the loader's shuffling
    sources = []
    for k, n_docs in enumerate(doc_counts):
        lens = rng.integers(1, 30, size=n_docs)
        tokens = np.arange(lens.sum(), dtype=np.uint32) + k * SOURCE_STRIDE
        offsets = np.concatenate([[0], np.cumsum(lens)])
        cut = n_docs // n_shards or n_docs  # spread the documents over several token arrays
        shards = [(tokens[offsets[i]:offsets[min(i + cut, n_docs)]],
                   offsets[i:min(i + cut, n_docs) + 1] - offsets[i]) for i in range(0, n_docs, cut)]
        sources.append(TokenSource(f"s{k}", shards, seed, shuffle))
    return Corpus(sources, list(weights), vocab_size=2 * SOURCE_STRIDE)


def _loader(rank=0, world=1, micro_batch=4, seq_len=16, seed=0, prefetch=0, **corpus_kw) -> TokenLoader:
    corpus = _corpus(seed=seed, **corpus_kw)
    node = PackedBatches(corpus, seq_len, micro_batch, rank, world, seed, "train", "test")
    return TokenLoader(node, corpus, prefetch)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _windows(batches) -> np.ndarray:
    """(rows, seq_len + 1) windows back from (inputs, targets)."""
    return np.concatenate([torch.cat([x, y[:, -1:]], dim=1).numpy() for x, y in batches])


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


def test_batches_shape_dtype_and_shift():
    x, y = next(_loader(micro_batch=3, seq_len=10))
    assert x.shape == y.shape == (3, 10) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_exact_resume_one_rank_across_epochs(prefetch):
    full = _take(_loader(prefetch=prefetch), 60)
    first = _loader(prefetch=prefetch)
    head = _take(first, 23)
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON survives a checkpoint
    resumed = _loader(prefetch=prefetch)
    resumed.load_state_dict(state)
    tail = _take(resumed, 37)
    assert _same(head + tail, full)
    end = resumed.state_dict()
    assert end["epochs"]["s0"] >= 1 and end["epochs"]["s1"] >= 2  # both sources crossed epoch boundaries
    assert state["epochs"]["s1"] < end["epochs"]["s1"]


def test_exact_resume_two_ranks():
    full = [_take(_loader(rank=r, world=2), 40) for r in range(2)]
    for r in range(2):
        first = _loader(rank=r, world=2, prefetch=2)
        head = _take(first, 17)
        resumed = _loader(rank=r, world=2, prefetch=2)
        resumed.load_state_dict(first.state_dict())
        assert _same(head + _take(resumed, 23), full[r])
    assert not _same(full[0], full[1])


def test_state_dict_before_iterating_and_after_loading():
    loader = _loader()
    start = loader.state_dict()
    assert start["global_seq"] == 0
    batches = _take(loader, 5)
    state = loader.state_dict()
    loader.load_state_dict(start)
    assert loader.state_dict()["global_seq"] == 0  # reflects the loaded state at once
    assert _same(_take(loader, 5), batches)
    assert loader.state_dict() == state


def test_one_epoch_split_over_ranks_sees_every_token_once():
    # One source of exactly 48 windows of 8 tokens: 2 ranks x micro_batch 3 x 8 steps.
    lens = [5, 9, 13, 2, 140, 7, 30, 11, 1, 19, 8, 50, 17, 40, 32]
    assert sum(lens) == 48 * 8
    offsets = np.concatenate([[0], np.cumsum(lens)])
    seen = []
    for rank in range(2):
        src = TokenSource("s", [(np.arange(offsets[-1], dtype=np.uint32), offsets)], seed=5)
        corpus = Corpus([src], [1.0], vocab_size=offsets[-1])
        loader = TokenLoader(PackedBatches(corpus, 7, 3, rank, 2, 5, "train", "test"), corpus, 0)
        seen.append(_windows(_take(loader, 8)).ravel())
        assert loader.state_dict()["epochs"]["s"] == 1  # exactly one epoch consumed
    assert not set(seen[0]) & set(seen[1])  # ranks read disjoint tokens
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(offsets[-1]))


def test_windows_pack_whole_documents_in_shuffled_order():
    windows = _windows(_take(_loader(world=1, micro_batch=2, doc_counts=(40,), weights=(1.0,)), 20))
    stream = windows[windows < SOURCE_STRIDE]
    assert np.array_equal(np.sort(stream[:500]), np.sort(np.unique(stream[:500])))  # no repeats within an epoch
    assert not np.array_equal(stream[:100], np.sort(stream[:100]))  # documents are shuffled


def test_mixture_proportions_over_10k_sequences():
    weights = (0.5, 0.3, 0.2)
    rows = []
    for rank in range(2):
        loader = _loader(rank=rank, world=2, micro_batch=10, seq_len=4, doc_counts=(30, 20, 10), weights=weights)
        rows.append(_windows(_take(loader, 500))[:, 0] // SOURCE_STRIDE)
    share = np.bincount(np.concatenate(rows), minlength=3) / 10_000
    assert np.all(np.abs(share - np.array(weights)) < 0.02), share


def test_too_small_weight_is_rejected():
    with pytest.raises(ConfigError, match="never sampled"):
        _loader(weights=(1.0, 1e-6))


def test_epochs_reshuffle_deterministically():
    def order(seed, shuffle=True, epoch=0):
        src = _corpus(seed=seed, shuffle=shuffle).sources[0]
        return src._table(epoch)[0]

    assert np.array_equal(order(0), order(0))
    assert not np.array_equal(order(0), order(1))
    assert not np.array_equal(order(0, epoch=0), order(0, epoch=1))
    assert np.array_equal(order(0, shuffle=False), np.arange(40))


@pytest.mark.parametrize(("world", "micro_batch"), [(1, 4), (4, 1)])
def test_world_size_change_continues_the_global_stream(world, micro_batch, caplog):
    old = [_loader(rank=r, world=2, micro_batch=2) for r in range(2)]
    for loader in old:
        _take(loader, 6)
    state = old[1].state_dict()  # any old rank's state holds the same global position
    assert state["global_seq"] == old[0].state_dict()["global_seq"] == 24
    # global order: step by step, rank by rank
    expected = np.stack([_windows(_take(loader, 5)).reshape(5, -1, 17) for loader in old], axis=1).reshape(-1, 17)
    new = []
    with caplog.at_level(logging.WARNING, logger="memlm.data"):
        for rank in range(world):
            loader = _loader(rank=rank, world=world, micro_batch=micro_batch)
            loader.load_state_dict(state)
            new.append(_windows(_take(loader, 5 * 4 // (world * micro_batch))))
    assert "world_size=2 state with world_size" in caplog.text
    got = np.stack([w.reshape(5, -1, 17) for w in new], axis=1).reshape(-1, 17)
    assert np.array_equal(got, expected)


def test_state_of_a_different_run_is_rejected():
    state = _take_state(_loader(seed=0))
    with pytest.raises(ConfigError, match="data.seed"):  # fails at load, not at the next batch
        _loader(seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="sources of the saved run"):
        _loader(doc_counts=(40,), weights=(1.0,)).load_state_dict(state)
    with pytest.raises(ConfigError, match="a dict from TokenLoader.state_dict"):
        _loader().load_state_dict({"root": {}})


def _take_state(loader):
    _take(loader, 3)
    return loader.state_dict()
