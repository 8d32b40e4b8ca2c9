"""Product-key lookup: exactness against brute force, knn switching, balance loss."""

from __future__ import annotations

import math

import pytest
import torch

from memlm.memory import ProductKeys, balance_loss, product_key_topk, subkey_scores
from memlm.memory.reference import all_slot_scores


def _brute_force_topk(query, keys, knn):
    """Score every one of the n_keys**2 slots with its full key [k1_i ; k2_j] (memory/reference.py)."""
    return all_slot_scores(query, keys).topk(knn, dim=-1)


@pytest.mark.parametrize("n_keys,knn,heads", [(8, 1, 1), (16, 4, 2), (32, 32, 3), (50, 7, 4)])
def test_product_key_search_equals_brute_force(n_keys, knn, heads):
    gen = torch.Generator().manual_seed(n_keys * 100 + knn)
    half = 6
    query = torch.randn(40, heads, 2, half, generator=gen, dtype=torch.float64)
    keys = torch.randn(heads, 2, n_keys, half, generator=gen, dtype=torch.float64)
    scores, slots = product_key_topk(subkey_scores(query, keys), knn)
    ref_scores, ref_slots = _brute_force_topk(query, keys, knn)
    assert slots.shape == (40, heads, knn)
    assert torch.equal(slots, ref_slots)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-12, atol=1e-12)


def test_lookup_weights_are_float32_softmax_and_knn_follows_mode():
    torch.manual_seed(0)
    lookup = ProductKeys(dim=12, n_keys=10, heads=3, knn=4, k_dim=8, eval_knn=6).to(torch.bfloat16)
    lookup.init_weights()
    x = torch.randn(5, 12, dtype=torch.bfloat16)
    weights, slots, sub = lookup.train()(x)
    assert weights.dtype == torch.float32 and sub.dtype == torch.float32
    assert weights.shape == slots.shape == (5, 3 * 4)
    torch.testing.assert_close(weights.view(5, 3, 4).sum(-1), torch.ones(5, 3))
    assert int(slots.min()) >= 0 and int(slots.max()) < 100
    weights, slots, _ = lookup.eval()(x)
    assert weights.shape == slots.shape == (5, 3 * 6)


def test_qk_norm_makes_scores_scale_free():
    torch.manual_seed(0)
    lookup = ProductKeys(dim=16, n_keys=8, heads=2, knn=3, k_dim=8, qk_norm=True).double()
    lookup.init_weights()
    x = torch.randn(7, 16, dtype=torch.float64)
    sub = lookup.sub_scores(x)
    with torch.no_grad():
        lookup.query.weight.mul_(100.0)
        lookup.query.bias.mul_(100.0)
        lookup.keys.mul_(0.01)
    torch.testing.assert_close(lookup.sub_scores(x), sub)
    # sqrt(half) * cosine: bounded by sqrt(half).
    assert float(sub.detach().abs().max()) <= math.sqrt(4) + 1e-9


def test_balance_loss_is_zero_for_uniform_and_log_n_for_collapse():
    n_keys = 16
    uniform = torch.zeros(9, 2, 2, n_keys)
    assert float(balance_loss(uniform)) == pytest.approx(0.0, abs=1e-6)
    collapsed = torch.full((9, 2, 2, n_keys), -1e4)
    collapsed[..., 3] = 1e4
    assert float(balance_loss(collapsed)) == pytest.approx(math.log(n_keys), rel=1e-5)
    # A skewed but not collapsed distribution lies in between, and has a gradient.
    scores = torch.randn(9, 2, 2, n_keys, requires_grad=True)
    loss = balance_loss(scores)
    loss.backward()
    assert 0 < float(loss.detach()) < math.log(n_keys)
    assert scores.grad.abs().sum() > 0


def test_bad_lookup_arguments_name_the_key():
    """A lookup built by hand raises a plain ValueError (not memlm's ConfigError:
    there is no config key), naming the argument, its value and what is valid."""
    from memlm.errors import ConfigError

    for kwargs, message in [({"k_dim": 7}, "k_dim=7 is invalid: a positive even integer"),
                            ({"knn": 5}, r"knn=5 is invalid: an integer in \[1, n_keys=4\]"),
                            ({"eval_knn": 0}, r"eval_knn=0 is invalid: an integer in \[1, n_keys=4\]"),
                            ({"heads": 0}, "heads=0 is invalid: an integer >= 1")]:
        with pytest.raises(ValueError, match=message) as err:
            ProductKeys(**{**dict(dim=8, n_keys=4, heads=1, knn=2, k_dim=8), **kwargs})
        assert not isinstance(err.value, ConfigError)
