"""SparseRowAdamW against torch.optim.AdamW, and clipping of sparse gradients."""

from __future__ import annotations

import pytest
import torch

from memlm.memory import SparseRowAdamW, clip_grad_norm_

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _sparse_grad(n, v, rows, seed):
    """A COO gradient with duplicate, unsorted row indices (as autograd accumulates them)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(len(rows), v, generator=gen)
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, (n, v), check_invariants=True)


def test_matches_adamw_when_every_row_is_touched():
    n, v = 6, 4
    torch.manual_seed(0)
    p_lazy = torch.nn.Parameter(torch.randn(n, v))
    p_ref = torch.nn.Parameter(p_lazy.detach().clone())
    lazy = SparseRowAdamW([p_lazy], **HYPER)
    ref = torch.optim.AdamW([p_ref], **HYPER, foreach=False)
    for step in range(4):
        # Every row appears at least once; rows 2 and 5 twice (summed).
        grad = _sparse_grad(n, v, [5, 0, 2, 1, 2, 3, 4, 5], seed=step)
        p_lazy.grad = grad
        p_ref.grad = grad.to_dense()
        lazy.step()
        ref.step()
        torch.testing.assert_close(p_lazy, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lazy.state[p_lazy]["exp_avg"], ref.state[p_ref]["exp_avg"])
    torch.testing.assert_close(lazy.state[p_lazy]["exp_avg_sq"], ref.state[p_ref]["exp_avg_sq"])


def test_untouched_rows_stay_frozen_and_touched_rows_follow_adamw():
    n, v = 8, 3
    torch.manual_seed(1)
    p_lazy = torch.nn.Parameter(torch.randn(n, v))
    p_ref = torch.nn.Parameter(p_lazy.detach().clone())
    start = p_lazy.detach().clone()
    lazy = SparseRowAdamW([p_lazy], **HYPER)
    ref = torch.optim.AdamW([p_ref], **HYPER, foreach=False)
    grad = _sparse_grad(n, v, [6, 1, 1, 4], seed=3)
    p_lazy.grad, p_ref.grad = grad, grad.to_dense()
    lazy.step()
    ref.step()
    touched = torch.tensor([1, 4, 6])
    untouched = torch.tensor([0, 2, 3, 5, 7])
    torch.testing.assert_close(p_lazy[touched], p_ref[touched], rtol=1e-6, atol=1e-7)
    assert torch.equal(p_lazy[untouched], start[untouched])  # not even weight decay
    assert not torch.equal(p_ref[untouched], start[untouched])  # dense AdamW decays them
    assert torch.count_nonzero(lazy.state[p_lazy]["exp_avg"][untouched]) == 0


def test_dense_gradients_are_plain_adamw():
    torch.manual_seed(2)
    p_a = torch.nn.Parameter(torch.randn(5, 2))
    p_b = torch.nn.Parameter(p_a.detach().clone())
    opt_a, opt_b = SparseRowAdamW([p_a], **HYPER), torch.optim.AdamW([p_b], **HYPER, foreach=False)
    for _ in range(3):
        g = torch.randn(5, 2)
        p_a.grad, p_b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(p_a, p_b, rtol=1e-6, atol=1e-7)


def test_rejects_bad_hyperparameters():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="learning rate"):
        SparseRowAdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        SparseRowAdamW([p], betas=(0.9, 1.0))


def test_clip_grad_norm_handles_sparse_and_dense_alike():
    torch.manual_seed(3)
    a = torch.nn.Parameter(torch.zeros(10, 4))
    b = torch.nn.Parameter(torch.zeros(3))
    a_dense, b_dense = torch.nn.Parameter(torch.zeros(10, 4)), torch.nn.Parameter(torch.zeros(3))
    a.grad = _sparse_grad(10, 4, [2, 7, 2], seed=5)
    b.grad = torch.randn(3)
    a_dense.grad, b_dense.grad = a.grad.to_dense(), b.grad.clone()
    norm = clip_grad_norm_([a, b], max_norm=0.5)
    ref = torch.nn.utils.clip_grad_norm_([a_dense, b_dense], max_norm=0.5)
    torch.testing.assert_close(norm, ref)
    assert norm > 0.5  # clipping happened
    torch.testing.assert_close(a.grad.to_dense(), a_dense.grad)
    torch.testing.assert_close(b.grad, b_dense.grad)
