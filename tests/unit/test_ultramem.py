"""UltraMemV2's layer (memory/ultramem.py): the fast path against the plain reference
(memory/ultramem_reference.py), its search against memlm's product-key search, the
implicit value expansion, the paper's init, the tables, and the errors."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from memlm.memory import ultramem_reference as ref
from memlm.memory.fast.search import half_topk, product_key_topk, subkey_scores
from memlm.memory.tables import sparse_tables, value_pools
from memlm.memory.ultramem import UltraMemV2, ffn_output_var
from memlm.memory.ultramem_search import candidate_keys, tucker_topk

SMALL = dict(n_keys=8, knn=4, k_dim=6, v_dim=5, pre_dim=3)
CONFIGS = [  # rank, heads, expansion, candidates (None: min(knn, n_keys))
    dict(rank=1, heads=1, expansion=1),
    dict(rank=1, heads=2, expansion=1, candidates=3),
    dict(rank=2, heads=2, expansion=4),
    dict(rank=3, heads=2, expansion=2, candidates=5),
]


def _layer(seed=0, dim=16, **kwargs) -> UltraMemV2:
    """A small layer with generic weights: a random core (off-diagonal terms, either
    sign) and unit-scale tables, so every term of the output matters."""
    torch.manual_seed(seed)
    layer = UltraMemV2(dim, **{**SMALL, **kwargs})
    with torch.no_grad():
        layer.lookup.core.normal_()
        layer.values.weight.normal_()
        layer.pre_values.weight.normal_()
    return layer


# ------------------------------------------------------------ fast == reference
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_the_forward_equals_the_reference_in_float32(cfg, training):
    layer = _layer(**cfg).train(training)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        assert torch.equal(layer(x), ref.reference_forward(layer, x))
        scores, addresses = layer.lookup(x.reshape(-1, 16))
        want_scores, want_addresses = ref.search(x.reshape(-1, 16), layer.lookup)
    assert torch.equal(scores, want_scores) and torch.equal(addresses, want_addresses)


def _gradients(layer, x, out, g):
    return torch.autograd.grad(out, [x, *layer.parameters()], g)


@pytest.mark.parametrize("cfg", CONFIGS[1:])
def test_the_float32_gradients_are_within_1e_6_of_the_reference(cfg):
    """Norm-wise per tensor. (A rank-1 single-head core is one scalar, a sum over every
    read with cancellation: there both paths are ~2e-6 from the float64 truth, so that
    case is held to the float64 test below.)"""
    layer = _layer(seed=3, **cfg)
    x = torch.randn(2, 7, 16, requires_grad=True)
    out, want = layer(x), ref.reference_forward(layer, x)
    g = torch.randn_like(out)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, _gradients(layer, x, out, g), _gradients(layer, x, want, g), strict=True):
        assert (a - b).norm() <= 1e-6 * b.norm(), name
        assert b.norm() > 0, name  # every tensor is in the graph


@pytest.mark.parametrize("cfg", CONFIGS)
def test_the_float64_gradients_equal_the_reference(cfg):
    layer = _layer(seed=4, **cfg).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    out, want = layer(x), ref.reference_forward(layer, x)
    assert torch.equal(out, want) or (out - want).abs().max() <= 1e-15 * want.abs().max()
    g = torch.randn_like(out)
    for a, b in zip(_gradients(layer, x, out, g), _gradients(layer, x, want, g), strict=True):
        assert (a - b).norm() <= 1e-12 * b.norm()


def test_a_wrong_reference_is_caught():
    """The comparison can fail: the exact top-k of the grid (no approximate step)
    differs from the layer's selection for some tokens when candidates < n_keys."""
    layer = _layer(rank=2, heads=2, candidates=2)
    x = torch.randn(64, 16)
    with torch.no_grad():
        addresses = layer.lookup(x)[1]
        row, col = ref.key_scores(*ref.normalized_query_and_keys(x, layer.lookup))
        exact = ref.grid_scores(row, layer.lookup.core, col).flatten(2).topk(layer.lookup.knn).indices
    assert torch.equal(addresses, ref.search(x, layer.lookup)[1])
    assert not torch.equal(addresses, exact)


def test_with_every_key_a_candidate_the_search_is_the_exact_top_k():
    gen = torch.Generator().manual_seed(1)
    row, col = torch.randn(2, 20, 3, 2, 10, generator=gen)
    core = torch.randn(3, 2, 2, generator=gen)
    scores, rows, cols = tucker_topk(row, col, core, candidates=10, knn=7)
    want = ref.grid_scores(row, core, col).flatten(2).topk(7)
    assert torch.equal(scores, want.values) and torch.equal(rows * 10 + cols, want.indices)


# ------------------------------------------------------------ against product keys
@pytest.mark.parametrize("n_keys,m,heads", [(8, 1, 1), (16, 4, 2), (50, 7, 3), (64, 64, 2)])
def test_at_rank_1_the_approximate_search_is_the_product_key_half_top_k(n_keys, m, heads):
    """Rank 1, C = [[1]]: the rows and columns kept (indices and scores) are memlm's
    product-key half top-k of the same query and keys, as Memory+'s search keeps them."""
    gen = torch.Generator().manual_seed(n_keys + m)
    q = torch.randn(30, heads, 2, 6, generator=gen)
    keys = torch.randn(heads, 2, n_keys, 6, generator=gen)
    sub = subkey_scores(q, keys)  # (T, H, 2, n)
    (row_s, row_i), (col_s, col_i) = candidate_keys(sub[:, :, :1], sub[:, :, 1:], torch.ones(heads, 1, 1), m)
    want_s, want_i = half_topk(sub, m)  # (T, H, 2, m)
    assert torch.equal(row_i, want_i[:, :, 0]) and torch.equal(col_i, want_i[:, :, 1])
    assert torch.equal(row_s, want_s[:, :, 0]) and torch.equal(col_s, want_s[:, :, 1])


def test_a_negative_rank_1_core_keeps_the_bottom_columns():
    """C = [[-1]]: u = 1, t = -1, so the kept pairs are top rows x bottom columns,
    where -s_row * s_col is largest among them."""
    sub = torch.randn(10, 1, 2, 12, generator=torch.Generator().manual_seed(2))
    (_, rows), (_, cols) = candidate_keys(sub[:, :, :1], sub[:, :, 1:], -torch.ones(1, 1, 1), 3)
    assert torch.equal(rows, sub[:, :, 0].topk(3).indices)
    assert torch.equal(cols, (-sub[:, :, 1]).topk(3).indices)


@pytest.mark.parametrize("n_keys,knn,heads", [(8, 1, 1), (16, 4, 2), (32, 32, 3), (50, 7, 4)])
def test_product_keys_are_tdqkr_with_a_constant_rank(n_keys, knn, heads):
    """Product keys score s1[i] + s2[j]; rank 1 scores c * s1[i] * s2[j], so the
    additive search is not a rank-1 case. It is the rank-2 one with a constant second
    score and the core [[0, 1], [1, 0]]: [s1, 1] C [s2, 1]^T = s1 + s2 exactly. With
    every key a candidate, TDQKR then selects what memlm's Memory+ search selects,
    the same scores and slots, bit for bit."""
    gen = torch.Generator().manual_seed(n_keys * 10 + knn)
    q = torch.randn(40, heads, 2, 6, generator=gen)
    keys = torch.randn(heads, 2, n_keys, 6, generator=gen)
    sub = subkey_scores(q, keys)  # (T, H, 2, n)
    ones = torch.ones_like(sub[:, :, 0])
    row, col = torch.stack([sub[:, :, 0], ones], 2), torch.stack([sub[:, :, 1], ones], 2)  # (T, H, 2, n)
    core = torch.tensor([[0.0, 1.0], [1.0, 0.0]]).expand(heads, 2, 2)
    scores, rows, cols = tucker_topk(row, col, core, candidates=n_keys, knn=knn)
    want_scores, want_slots = product_key_topk(sub, knn, ordered=True)
    assert torch.equal(scores, want_scores)
    assert torch.equal(rows * n_keys + cols, want_slots)


# ------------------------------------------------------------ implicit value expansion
@pytest.mark.parametrize("expansion", [1, 2, 4, 16])
def test_each_table_row_takes_expansion_grid_addresses(expansion):
    layer = UltraMemV2(16, **{**SMALL, "expansion": expansion})
    assert layer.n_rows * expansion == 64 and layer.values.weight.shape == (layer.n_rows, 5)
    rows = layer.table_rows(torch.arange(64))
    assert torch.equal(torch.bincount(rows, minlength=layer.n_rows), torch.full((layer.n_rows,), expansion))
    if expansion > 1:  # a fixed map, carried by checkpoints
        assert torch.equal(layer.state_dict()["address_rows"], UltraMemV2(16, **{**SMALL, "expansion": expansion})
                           .address_rows)
        assert not torch.equal(rows, torch.arange(64) % layer.n_rows)  # shuffled, not a plain modulo



# ------------------------------------------------------------ the paper's init
def test_the_init_gives_mean_one_scores_and_the_ffn_output_variance():
    """Unit-RMS inputs: the knn scores average ~1 (the calibrated query scale), and the
    output variance is the FFN's the paper matches (within 25%: its derivation's
    central-limit and independence steps hold only approximately; measured 0.97x here)."""
    torch.manual_seed(0)
    layer = UltraMemV2(256, n_keys=64, heads=2, rank=2, knn=16, n_layers=4, ffn_mult=3.0)
    x = torch.randn(4096, 256)
    with torch.no_grad():
        scores = layer.lookup(x)[0]
        var = layer(x).var().item()
    assert abs(scores.mean().item() - 1) < 0.05
    assert abs(scores.std().item() - layer.lookup.score_std) < 0.1
    target = ffn_output_var(4, 3.0)
    assert target / 1.25 < var < target * 1.25, (var, target)


def test_the_value_std_solves_the_papers_variance_equation():
    layer = UltraMemV2(64, n_keys=16, heads=2, rank=2, knn=8, n_layers=6, ffn_mult=2.5)
    s2, sv, lk = layer.init_std**2, layer.value_std(), layer.lookup
    out_var = layer.v_dim * s2 * lk.heads * lk.knn * sv**4 * layer.pre_dim * 64 * s2 * (1 + lk.score_std**2)
    assert out_var == pytest.approx(ffn_output_var(6, 2.5), rel=1e-12)
    assert layer.values.init_std == pytest.approx(sv, rel=1e-12)
    assert layer.pre_values.weight.std().item() == pytest.approx(sv, rel=0.05)


# ------------------------------------------------------------ tables, precision
def test_the_tables_are_sparse_tables_and_v_is_a_value_pool():
    layer = UltraMemV2(16, **SMALL)
    assert [id(p) for p in sparse_tables(layer)] == [id(layer.pre_values.weight), id(layer.values.weight)]
    assert value_pools(layer) == [layer.values] and layer.values.reads_per_token == 1 * 4


def test_reads_add_into_the_value_gradient_buffer():
    """The read goes through ValuePool.read: with a buffer (the table's .grad), every
    backward adds into that same tensor, rows read only."""
    layer = _layer(rank=2, heads=2)
    buffer = torch.zeros_like(layer.values.weight)
    layer.values.weight.grad = buffer
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).square().sum().backward()
    assert layer.values.weight.grad is buffer
    rows = layer.table_rows(layer.lookup(x)[1]).unique()
    assert torch.equal(buffer.abs().sum(1).nonzero().flatten(), rows)


def test_sparse_updates_give_the_dense_gradient_as_rows():
    dense, sparse = _layer(rank=2), _layer(rank=2, sparse_updates=True)
    x = torch.randn(5, 16)
    dense(x).sum().backward()
    sparse(x).sum().backward()
    assert sparse.values.weight.grad.is_sparse
    assert torch.equal(sparse.values.weight.grad.to_dense(), dense.values.weight.grad)


def test_the_selection_is_float32_under_autocast():
    layer = _layer(rank=2, heads=2)
    x = torch.randn(32, 16)
    with torch.no_grad():
        want = layer.lookup(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer.lookup(x)
    assert got[0].dtype == torch.float32 and torch.equal(got[1], want[1])


def test_usage_counts_reads_in_training_only():
    layer = _layer(rank=2, heads=2)
    layer.eval()(torch.randn(3, 16))
    assert layer.usage.counts.sum() == 0
    layer.train()(torch.randn(3, 16))
    assert layer.usage.counts.sum() == 3 * 2 * 4


# ------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs,key,valid", [
    (dict(n_keys=0), "n_keys=0", "an integer >= 1"),
    (dict(rank=0), "rank=0", "an integer >= 1"),
    (dict(heads=-1), "heads=-1", "an integer >= 1"),
    (dict(candidates=9), "candidates=9", "an integer in [1, n_keys=8]"),
    (dict(candidates=0), "candidates=0", "an integer in [1, n_keys=8]"),
    (dict(v_dim=0), "v_dim=0", "an integer >= 1"),
    (dict(knn=0), "knn=0", "an integer >= 1"),
    (dict(knn=10, candidates=3), "knn=10", "an integer in [1, candidates**2=9] (candidates=3)"),
    (dict(expansion=3), "expansion=3", "an integer >= 1 dividing n_keys**2=64"),
    (dict(ffn_mult=0.0), "ffn_mult=0.0", "a number > 0"),
    (dict(kernel="cuda"), "kernel='cuda'", "one of auto, triton, torch"),
])
def test_bad_values_name_the_value_and_what_is_valid(kwargs, key, valid):
    with pytest.raises(ValueError, match=re.escape(f"{key} is invalid: {valid}")):
        UltraMemV2(16, **{**SMALL, **kwargs})


def test_a_knn_too_large_for_the_init_says_so():
    with pytest.raises(ValueError, match=re.escape("knn=64 is invalid for the paper's init")):
        UltraMemV2(16, **{**SMALL, "knn": 64, "candidates": 8})


# ------------------------------------------------------------ docs
def test_the_docs_example_runs():
    text = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    section = text[text.index("## UltraMemV2 (standalone layer)"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "docs/memory.md", "exec"), namespace)
    assert namespace["y"].shape == namespace["x"].shape


def test_init_weights_sets_the_deterministic_part_of_the_init_again():
    layer = UltraMemV2(16, **SMALL)
    fresh = copy.deepcopy(layer.state_dict())
    torch.manual_seed(0)
    layer.init_weights()
    for name, tensor in layer.state_dict().items():
        deterministic = name.startswith("lookup.") and not name.endswith(("keys", "query.weight"))
        assert not deterministic or torch.equal(tensor, fresh[name]), name
