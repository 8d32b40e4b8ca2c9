"""memory/slot_selection.py and memory/sparse_sgd.py: the ranking against a
hand-computed example, a background that discriminates where a batch reads
every slot, and optimizers that touch the selected rows alone."""

from __future__ import annotations

import math

import pytest
import torch

from memlm.memory.slot_selection import background_probability, restrict_table_grad_, slot_scores, top_slots
from memlm.memory.sparse_adamw import SparseRowAdamW
from memlm.memory.sparse_sgd import SparseRowSGD

# 4 slots. Background reads 6, 2, 0, 0 (8 in all): with one read added to each slot,
# p = 7/12, 3/12, 1/12, 1/12. The batch reads 1, 0, 3, 2 (6 in all): q = 1/6, 0, 1/2, 1/3.
BACKGROUND = torch.tensor([6, 2, 0, 0])
BATCH = torch.tensor([1, 0, 3, 2])


def test_background_probability_adds_one_read_to_every_slot():
    assert background_probability(BACKGROUND).tolist() == pytest.approx([7 / 12, 3 / 12, 1 / 12, 1 / 12])


def test_tfidf_and_kl_equal_the_hand_computed_scores():
    tfidf = slot_scores(BATCH, BACKGROUND, "tfidf")
    assert tfidf[[0, 2, 3]].tolist() == pytest.approx([1 * math.log(12 / 7), 3 * math.log(12), 2 * math.log(12)])
    kl = slot_scores(BATCH, BACKGROUND, "kl")
    assert kl[[0, 2, 3]].tolist() == pytest.approx([(1 / 6) * math.log((1 / 6) / (7 / 12)),
                                                    (1 / 2) * math.log((1 / 2) / (1 / 12)),
                                                    (1 / 3) * math.log((1 / 3) / (1 / 12))])
    # the KL terms sum to KL(q || p)
    q = torch.tensor([1 / 6, 1 / 2, 1 / 3], dtype=torch.float64)
    p = torch.tensor([7 / 12, 1 / 12, 1 / 12], dtype=torch.float64)
    assert float(kl[[0, 2, 3]].sum()) == pytest.approx(float((q * (q / p).log()).sum()))
    for scores in (tfidf, kl):  # a slot the batch did not read is never a candidate
        assert scores[1] == float("-inf")
        assert top_slots(scores, BATCH, 2).tolist() == [2, 3]
        assert top_slots(scores, BATCH, 10).tolist() == [0, 2, 3]  # at most the slots read


def test_ties_go_to_the_lower_slot():
    batch, background = torch.tensor([2, 2, 2, 2]), torch.tensor([5, 5, 5, 5])
    for ranking in ("tfidf", "kl"):
        assert top_slots(slot_scores(batch, background, ranking), batch, 2).tolist() == [0, 1]


def test_a_bad_ranking_or_shape_is_refused():
    with pytest.raises(ValueError, match="expected one of tfidf, kl"):
        slot_scores(BATCH, BACKGROUND, "idf")
    with pytest.raises(ValueError, match="differ"):
        slot_scores(BATCH, BACKGROUND[:3], "kl")


@pytest.mark.parametrize("ranking", ["tfidf", "kl"])
def test_the_ranking_discriminates_when_the_batch_reads_every_slot(ranking):
    """With a batch as the document, a batch that reads every slot gives every
    slot the same document frequency (the saturation the issue measured). The
    read-count background still ranks: among slots the batch reads equally
    often, the ones the background rarely reads come first."""
    gen = torch.Generator().manual_seed(0)
    n, t = 1024, 64
    background = (1e5 / torch.arange(1, n + 1).double()).long()  # Zipf-like pretraining reads
    background = background[torch.randperm(n, generator=gen)]
    batch = 3 + torch.randint(0, 3, (n,), generator=gen)  # every slot read 3-5 times
    scores = slot_scores(batch, background, ranking)
    rows = top_slots(scores, batch, t)
    assert torch.isfinite(scores).all() and scores.unique().numel() > t  # not one tied score
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[rows] = True
    # the selected slots are among the background's rarer half, not an arbitrary set
    assert background[chosen].max() <= background.double().median()
    # and among equal batch counts, rarer background always ranks at least as high
    for c in (3, 4, 5):
        same = (batch == c).nonzero().squeeze(1)
        order = scores[same].argsort(descending=True)
        assert (background[same][order].diff() >= 0).all()


def _table_with_grad(sparse: bool) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(1)
    table = torch.nn.Parameter(torch.randn(10, 3, generator=gen))
    rows = torch.tensor([1, 4, 4, 7, 9])
    values = torch.randn(5, 3, generator=gen)
    grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (10, 3))
    table.grad = grad if sparse else grad.to_dense()
    return table


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grad", "sparse-grad"])
def test_restrict_keeps_only_the_selected_rows(sparse):
    table = _table_with_grad(sparse)
    full = table.grad.to_dense().clone()
    restrict_table_grad_(table, torch.tensor([4, 7, 8]))
    kept = table.grad.to_dense()
    assert table.grad.is_sparse
    assert torch.equal(kept[[4, 7, 8]], full[[4, 7, 8]])
    others = torch.tensor([i for i in range(10) if i not in (4, 7, 8)])
    assert not kept[others].any()


@pytest.mark.parametrize("make", [lambda p: SparseRowAdamW([p], lr=0.1, weight_decay=0.1),
                                  lambda p: SparseRowSGD([p], lr=0.5, weight_decay=0.1)], ids=["adamw", "sgd"])
def test_the_row_optimizers_change_the_selected_rows_alone(make):
    table = _table_with_grad(sparse=False)
    opt = make(table)
    for _ in range(3):  # moments from earlier steps must not move unselected rows either
        before = table.detach().clone()
        table.grad = _table_with_grad(sparse=False).grad
        restrict_table_grad_(table, torch.tensor([4, 7]))
        opt.step()
        opt.zero_grad()
        changed = (table.detach() != before).any(1).nonzero().squeeze(1).tolist()
        assert changed == [4, 7]


def test_sgd_is_plain_sgd_on_the_rows_and_skips_on_found_inf():
    table = _table_with_grad(sparse=True)
    grad, before = table.grad.to_dense().clone(), table.detach().clone()
    opt = SparseRowSGD([table], lr=0.5)
    opt.found_inf = torch.ones(())
    opt.step()
    assert torch.equal(table.detach(), before)  # a skipped step changes nothing
    del opt.found_inf
    opt.step()
    torch.testing.assert_close(table.detach(), before - 0.5 * grad, rtol=0, atol=1e-7)


def test_tfidf_over_batches_is_lin_et_als_formula():
    """tfidf_batches: the batch's share of reads times log(B / (1 + d)), d the background batches (of B)
    that read the slot; a slot every background batch read scores below zero."""
    batches_read, n_batches = torch.tensor([9, 0, 1, 3]), 10
    scores = slot_scores(BATCH, batches_read, "tfidf_batches", n_batches)
    assert scores[1] == float("-inf")  # not read by the batch: never a candidate
    assert scores[[0, 2, 3]].tolist() == pytest.approx([(1 / 6) * math.log(10 / 10), (1 / 2) * math.log(10 / 2),
                                                        (1 / 3) * math.log(10 / 4)])
    assert top_slots(scores, BATCH, 2).tolist() == [2, 3]
    assert slot_scores(BATCH, torch.tensor([10, 0, 1, 3]), "tfidf_batches", 10)[0] < 0
    with pytest.raises(ValueError, match="needs the background's batch count"):
        slot_scores(BATCH, batches_read, "tfidf_batches")
