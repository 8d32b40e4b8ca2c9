"""memory/fast/native_topk.py: the C top-k kernel gives torch.topk's results."""

from __future__ import annotations

import pytest
import torch

import memlm.memory.fast.native_topk as native


@pytest.fixture(autouse=True)
def _kernel_required():
    # Every machine memlm's tests run on has a C compiler (torch.compile needs
    # one too): a missing kernel is a failure here, not a silent fallback.
    assert native.available(), "the native top-k kernel did not build (see the RuntimeWarning)"


def distinct(*shape, seed=0):
    """Float32 values without ties (a random permutation), so indices are unique."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n, generator=gen).float() - n / 2).view(*shape) / 7


@pytest.mark.parametrize("n,k", [(128, 32), (119, 32), (1024, 32), (32, 32), (37, 1), (300, 64), (128, 128), (9, 8)])
def test_equals_torch_topk(n, k):
    x = distinct(53, n, seed=n + k)  # 53 rows: not a multiple of the vector lanes
    values, indices = native.topk(x, k)
    ref_values, ref_indices = x.topk(k, dim=-1)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)


def test_strided_leading_dims():
    # The product-key scores are a permuted view (T, H, 2, n) of the einsum's output.
    x = distinct(4, 2, 6, 128, seed=1).permute(2, 0, 1, 3)
    assert not x.is_contiguous()
    values, indices = native.topk(x, 32)
    ref_values, ref_indices = x.topk(32, dim=-1)
    assert values.shape == (6, 4, 2, 32)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)


def assert_same_as_torch(x, k):
    """native.topk(x, k) == torch.topk(x, k, dim=-1): indices, and values bit for bit (NaN included)."""
    values, indices = native.topk(x, k)
    ref_values, ref_indices = x.topk(k, dim=-1)
    assert torch.equal(indices, ref_indices)
    assert torch.equal(values.view(torch.int32), ref_values.view(torch.int32))


LEVELS = torch.tensor([2.0, -1.5, 0.0, -0.0, 0.25, float("inf"), float("-inf"), float("nan")])


@pytest.mark.parametrize("n,k", [(128, 32), (119, 32), (1024, 32), (2048, 32), (32, 32), (37, 1), (64, 16),
                                 (50, 16), (300, 64), (128, 128), (9, 8), (4096, 16)])
@pytest.mark.parametrize("levels", [2, 5, 8])
def test_ties_pick_what_torch_topk_picks(n, k, levels):
    # torch.topk keeps equal values in the order its std::nth_element and
    # std::sort leave them, not the lower index first: every row here ties.
    gen = torch.Generator().manual_seed(n * 31 + k * 7 + levels)
    x = LEVELS[torch.randint(0, levels, (45, n), generator=gen)]
    x[0] = 1.0  # a whole row equal
    x[1] = -0.0
    x[2, ::2] = -0.0  # -0.0 and 0.0 are equal to torch.topk
    x[3] = float("nan")
    x[4] = torch.randn(n, generator=gen).bfloat16().float()  # bf16-quantized scores: ties
    x[5] = torch.randn(n, generator=gen).mul(4).round() / 4
    assert_same_as_torch(x, k)


def test_ties_in_the_search_shapes_and_strided_rows():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 2, 6, 128, generator=gen).bfloat16().float().permute(2, 0, 1, 3)  # as the search's view
    assert_same_as_torch(x, 32)
    assert_same_as_torch(x[..., :64], 16)
    assert_same_as_torch(x[1:, :, :, 7:71], 16)  # rows from a storage offset: tied rows are re-read from it


def test_only_rows_whose_top_k_ties_leave_the_kernel(monkeypatch):
    redone = []
    real = native._redo_with_torch

    def spy(x, offsets, tied, k, values, indices):
        redone.append(tied.clone())
        real(x, offsets, tied, k, values, indices)

    monkeypatch.setattr(native, "_redo_with_torch", spy)
    native.topk(distinct(300, 128, seed=2), 32)
    assert redone == []  # no ties: the kernel answers every row
    x = distinct(4, 64, seed=3)
    order = x.argsort(dim=-1, descending=True)  # (4, 64)
    x[0, order[0, 40:]] = -5e3  # ties below the top 16 only
    x[1, order[1, 16]] = x[1, order[1, 15]]  # the 16th equals one left out
    x[2, order[2, 3]] = x[2, order[2, 2]]  # two equal among the top 16
    x[3, order[3, 0]], x[3, order[3, 1]] = 0.0, -0.0  # equal to torch.topk
    x[3, order[3, 2:]] = -1e4 - torch.arange(62.0)
    assert_same_as_torch(x, 16)
    assert len(redone) == 1 and redone[0].tolist() == [False, True, True, True]


def test_product_key_search_with_ties_equals_the_search_through_torch_topk(monkeypatch):
    # The same search (block maxima, candidate pairs) with torch.topk in place
    # of the kernel: equal slots and scores, on bf16-quantized sub-key scores.
    import memlm.memory.fast.search as search

    gen = torch.Generator().manual_seed(11)
    for n_keys, knn in [(64, 16), (1024, 32), (128, 32)]:
        sub = torch.randn(40, 2, 2, n_keys, generator=gen).mul(3).bfloat16().float()
        scores, slots = search.product_key_topk(sub, knn)
        monkeypatch.setattr(search, "rows_topk", lambda x, k: x.topk(k, dim=-1))
        ref_scores, ref_slots = search.product_key_topk(sub, knn)
        monkeypatch.undo()
        assert torch.equal(slots, ref_slots) and torch.equal(scores, ref_scores)


def test_nan_ranks_highest_and_padding_never_wins():
    x = torch.full((3, 40), float("-inf"))  # 40: padded to 64 inside
    x[1, 7] = float("nan")
    x[2, :5] = torch.tensor([1.0, float("inf"), -2.0, float("nan"), 0.0])
    values, indices = native.topk(x, 32)
    assert (indices < 40).all() and (indices >= 0).all()
    assert all(len(set(row.tolist())) == 32 for row in indices)
    assert values[1, 0].isnan() and indices[1, 0] == 7
    assert values[2, 0].isnan() and indices[2, 0] == 3
    assert values[2, 1:5].tolist() == [float("inf"), 1.0, 0.0, -2.0]
    assert torch.isneginf(values[:, 5:]).all()


def test_threads_split_rows_with_the_same_result():
    x = distinct(5000, 128, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.topk(x, 32)
        torch.set_num_threads(3)  # 3 parts, whatever the machine has
        three = native.topk(x, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])


def test_values_carry_autograd():
    x = distinct(6, 64, seed=4).requires_grad_()
    probe = torch.randn(6, 16)
    values, _ = native.topk(x, 16)
    (grad,) = torch.autograd.grad((values * probe).sum(), x)
    ref_values, _ = x.topk(16, dim=-1)
    (ref,) = torch.autograd.grad((ref_values * probe).sum(), x)
    assert torch.equal(grad, ref)


@pytest.mark.parametrize("case", ["float64", "k=24", "strided columns", "k>n"])
def test_unsupported_inputs_fall_back_to_torch(case):
    x = distinct(10, 64, seed=5)
    k = 16
    if case == "float64":
        x = x.double()
    elif case == "k=24":
        k = 24
    elif case == "strided columns":
        x = distinct(64, 10, seed=5).t()
    else:
        x, k = x[:, :8], 16
        with pytest.raises(RuntimeError):
            native.topk(x, k)
        return
    assert not native._supported(x, k)
    values, indices = native.topk(x, k)
    ref_values, ref_indices = x.topk(k, dim=-1)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)


def test_switch_and_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    try:
        native._library.cache_clear()
        monkeypatch.setenv(native.ENABLE_ENV, "0")
        assert native._library() is None  # switched off: no warning, no build
        native._library.cache_clear()
        monkeypatch.setenv(native.ENABLE_ENV, "1")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        with pytest.warns(RuntimeWarning, match="no-such-cc"):
            assert native._library() is None
        x = distinct(10, 64)
        assert torch.equal(native.topk(x, 8)[1], x.topk(8, dim=-1)[1])  # torch.topk then
        native._library.cache_clear()
        monkeypatch.delenv("CC")
        assert native._library() is not None  # builds into the fresh cache dir
        assert list((tmp_path / "native").glob("topk_rows-*.so"))
    finally:
        native._library.cache_clear()


@pytest.mark.parametrize("n_keys,knn", [(128, 32), (1024, 32), (64, 8)])
def test_product_key_search_through_the_kernel_equals_brute_force(monkeypatch, n_keys, knn):
    # Sub-key scores whose n_keys**2 pair sums are distinct and exact in
    # float32 (s1 multiples of 4096, s2 below 4096), so the winners are unique.
    import memlm.memory.fast.search as search

    calls = []

    def spy(x, k):
        calls.append(native._supported(x, k))
        return native.topk(x, k)

    monkeypatch.setattr(search, "rows_topk", spy)
    gen = torch.Generator().manual_seed(n_keys)
    tokens, heads = 33, 3
    s1 = torch.stack([torch.randperm(n_keys, generator=gen) for _ in range(tokens * heads)]).float() * 4096
    s2 = torch.stack([torch.randperm(4096, generator=gen)[:n_keys] for _ in range(tokens * heads)]).float()
    sub = torch.stack([s1, s2], dim=1).view(tokens, heads, 2, n_keys)
    scores, slots = search.product_key_topk(sub, knn)
    pair_sums = (sub[:, :, 0].unsqueeze(-1) + sub[:, :, 1].unsqueeze(-2)).flatten(-2)
    ref_scores, ref_slots = pair_sums.topk(knn, dim=-1)
    assert calls and all(calls), "every top-k of the CPU float32 search goes through the kernel"
    assert torch.equal(slots, ref_slots) and torch.equal(scores, ref_scores)
