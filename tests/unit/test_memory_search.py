"""product_key_search: same selection as the dense path, and a backward through
the selected sub-keys only that equals autograd's dense gradient (float64);
the TF32-free matmuls of memlm.memory.fast.exact against the plain ops."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import memlm.memory.fast.ops as ops
import memlm.memory.fast.search as search
import memlm.memory.fast.search_grad as search_grad
from memlm.memory import (
    MemoryPlus,
    ProductKeys,
    balance_loss,
    product_key_search,
    product_key_topk,
    subkey_scores,
)
from memlm.memory.fast.exact import exact_linear, exact_subkey_scores


def _inputs(tokens=24, heads=3, n_keys=40, half=5, shared=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 2, half, generator=gen, dtype=torch.float64, requires_grad=True)
    shape = (2, n_keys, half) if shared else (heads, 2, n_keys, half)
    keys = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, keys


@pytest.fixture(params=["sparse", "sparse-all-ranks", "dense"])
def backward(request, monkeypatch):
    """Run a test with each backward: sparse (gathers; reads of the used ranks
    only, as on CPU, or of all ranks, as on an accelerator) and dense (matmuls)."""
    monkeypatch.setattr(search_grad, "SPARSE_BACKWARD_RATIO", 10**9 if request.param == "dense" else 0)
    if request.param == "sparse-all-ranks":
        monkeypatch.setattr(search_grad, "_compact_reads", lambda device: False)
    return request.param


@pytest.mark.parametrize("n_keys,knn", [(64, 4), (40, 8), (12, 12), (128, 2)])
def test_half_topk_equals_torch_topk(n_keys, knn):
    # (64, 4), (128, 2): the block-maxima path; the others: plain torch.topk.
    gen = torch.Generator().manual_seed(n_keys)
    scores = torch.randn(4, 3, 2, 7, n_keys, generator=gen, dtype=torch.float64).transpose(0, 3)  # not contiguous
    values, idx = search.half_topk(scores, knn)
    ref_values, ref_idx = scores.topk(knn, dim=-1)
    assert torch.equal(values, ref_values) and torch.equal(idx, ref_idx)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("n_keys,knn", [(40, 8), (64, 3), (9, 9)])
def test_forward_equals_dense_path(shared, n_keys, knn):
    q, keys = _inputs(n_keys=n_keys, shared=shared)
    scores, slots, sub = product_key_search(q, keys, knn, keep_sub=True)
    ref_sub = subkey_scores(q, keys)
    ref_scores, ref_slots = product_key_topk(ref_sub, knn)
    assert torch.equal(slots, ref_slots)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=0)
    torch.testing.assert_close(sub, ref_sub, rtol=0, atol=0)
    # And brute force: every one of the n_keys**2 pair sums.
    pair_sums = (ref_sub[:, :, 0].unsqueeze(-1) + ref_sub[:, :, 1].unsqueeze(-2)).flatten(-2)
    brute_scores, brute_slots = pair_sums.topk(knn, dim=-1)
    assert torch.equal(slots, brute_slots)
    torch.testing.assert_close(scores, brute_scores, rtol=1e-14, atol=1e-14)
    assert scores.requires_grad and not sub.requires_grad and not slots.requires_grad


@pytest.mark.parametrize("n_keys,knn", [(40, 8), (64, 3), (9, 9), (128, 32)])
def test_unordered_search_keeps_the_same_winners(backward, n_keys, knn):
    # The layers ask for the winners unordered (ordered=False): the same
    # (score, slot) pairs, and the same gradients, as the ordered search.
    q, keys = _inputs(n_keys=n_keys, seed=2)
    scores, slots, _ = product_key_search(q, keys, knn, ordered=False)
    ref_scores, ref_slots, _ = product_key_search(q, keys, knn)
    order = scores.argsort(dim=-1, descending=True)
    assert torch.equal(slots.gather(-1, order), ref_slots)
    assert torch.equal(scores.gather(-1, order), ref_scores)
    dense_scores, dense_slots = product_key_topk(subkey_scores(q, keys), knn, ordered=False)
    assert torch.equal(dense_slots.sort(-1).values, ref_slots.sort(-1).values)
    probe = torch.randn(q.shape[0], q.shape[1], n_keys**2, dtype=torch.float64)  # a weight per slot
    got = torch.autograd.grad((scores * probe.gather(-1, slots)).sum(), (q, keys))
    want = torch.autograd.grad((ref_scores * probe.gather(-1, ref_slots)).sum(), (q, keys))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("n_keys,knn", [(40, 8), (64, 3), (9, 9)])
def test_gradients_equal_autograd_through_dense_path(backward, shared, n_keys, knn):
    q, keys = _inputs(n_keys=n_keys, shared=shared, seed=1)
    probe = torch.randn(q.shape[0], q.shape[1], knn, dtype=torch.float64)
    scores, _, _ = product_key_search(q, keys, knn)
    got = torch.autograd.grad((scores * probe).sum(), (q, keys))
    ref_scores, _ = product_key_topk(subkey_scores(q, keys), knn)
    want = torch.autograd.grad((ref_scores * probe).sum(), (q, keys))
    for name, g, w in zip(("query", "keys"), got, want):
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("shared", [False, True])
def test_gradcheck(backward, shared):
    q, keys = _inputs(tokens=3, heads=2, n_keys=6, half=3, shared=shared, seed=2)
    # Spread the keys so that a small perturbation does not change the selection.
    keys = (keys.detach() * 4).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: product_key_search(a, b, 4)[0], (q, keys))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_lookup_gradcheck(backward, qk_norm):
    torch.manual_seed(1)
    lookup = ProductKeys(dim=4, n_keys=6, heads=2, knn=3, k_dim=4, qk_norm=qk_norm).double()
    lookup.init_weights()
    with torch.no_grad():
        lookup.keys.mul_(8.0)  # well-separated scores: the selection is stable under gradcheck's steps
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    names = [name for name, _ in lookup.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in lookup.parameters())

    def weights(x, *params):
        return functional_call(lookup, dict(zip(names, params)), (x,))[0]

    assert torch.autograd.gradcheck(weights, (x, *params))


def test_only_the_query_or_only_the_keys(backward):
    q, keys = _inputs(seed=3)
    scores, _, _ = product_key_search(q.detach(), keys, 5)
    (g_keys,) = torch.autograd.grad(scores.sum(), keys)
    scores, _, _ = product_key_search(q, keys.detach(), 5)
    (g_q,) = torch.autograd.grad(scores.sum(), q)
    ref = torch.autograd.grad(product_key_topk(subkey_scores(q, keys), 5)[0].sum(), (q, keys))
    torch.testing.assert_close(g_q, ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_keys, ref[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_lookup_gradients_equal_dense_path(backward, qk_norm):
    """ProductKeys: the sparse search (sub "none" or "detached") and the
    differentiable-sub path give the same weights, slots and parameter gradients."""
    torch.manual_seed(0)
    lookup = ProductKeys(dim=10, n_keys=24, heads=2, knn=5, k_dim=8, qk_norm=qk_norm).double()
    lookup.init_weights()
    x = torch.randn(30, 10, dtype=torch.float64)
    probe = torch.randn(30, 2 * 5, dtype=torch.float64)
    grads, outs = [], []
    for sub in ("none", "detached", "grad"):
        lookup.zero_grad()
        weights, slots, sub_scores = lookup(x, sub=sub)
        if sub == "none":
            assert sub_scores is None
        else:
            assert sub_scores.shape == (30, 2, 2, 24) and sub_scores.requires_grad == (sub == "grad")
        (weights * probe).sum().backward()
        outs.append((weights.detach(), slots))
        grads.append([p.grad.clone() for p in lookup.parameters()])
    for out in outs[1:]:
        torch.testing.assert_close(out[0], outs[0][0], rtol=0, atol=0)
        assert torch.equal(out[1], outs[0][1])
    for other in grads[1:]:
        for g, w in zip(grads[0], other):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="sub must be"):
        lookup(x, sub="yes")


def test_search_in_chunks_of_tokens_equals_whole(backward, monkeypatch):
    q, keys = _inputs(tokens=50, n_keys=40, seed=4)
    probe = torch.randn(50, 3, 6, dtype=torch.float64)
    whole = product_key_search(q, keys, 6, keep_sub=True)
    # 3 heads x 2 halves x 40 keys x 8 bytes = 1920 bytes per token: chunks of 7 tokens.
    monkeypatch.setattr(search_grad, "CHUNK_BYTES", 7 * 1920)
    chunked = product_key_search(q, keys, 6)
    assert chunked[2] is None
    assert torch.equal(chunked[1], whole[1])
    # A matmul over fewer rows may block (and round) differently.
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-14, atol=1e-14)
    got = torch.autograd.grad((chunked[0] * probe).sum(), (q, keys))
    want = torch.autograd.grad((whole[0] * probe).sum(), (q, keys))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-14)


def test_balance_loss_gradient_adds_to_the_sparse_read():
    """With the balance loss on, the layer takes the dense path; its gradients
    equal the sparse path's plus the balance loss's own (gradients are linear)."""
    def layer(coef):
        torch.manual_seed(0)
        mem = MemoryPlus(12, n_keys=20, heads=2, knn=4, k_dim=8, balance_loss_coef=coef).double()
        mem.init_weights()
        return mem

    x = torch.randn(16, 12, dtype=torch.float64)
    probe = torch.randn(16, 12, dtype=torch.float64)
    on = layer(0.3)
    ((on(x) * probe).sum() + on.last_aux_loss).backward()
    off = layer(0.0)
    (off(x) * probe).sum().backward()
    assert off.last_aux_loss is None
    (0.3 * balance_loss(off.lookup.sub_scores(x))).backward()
    for (name, a), b in zip(on.named_parameters(), off.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_weight_gradients_in_slot_order_are_bit_identical():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(50, 16, generator=gen)
    indices = torch.randint(0, 20, (30, 7), generator=gen)
    weights = torch.rand(30, 7, generator=gen)
    grad_out = torch.randn(30, 16, generator=gen)
    plain = ops.weight_gradients(values, indices, grad_out)
    by_slot = ops.weight_gradients(values, indices, grad_out, ops.sort_reads(indices, 50))
    assert torch.equal(plain, by_slot)
    assert torch.equal(
        ops.dense_gradient(indices, weights, grad_out, 50),
        ops.dense_gradient(indices, weights, grad_out, 50, ops.sort_reads(indices)),
    )


@pytest.mark.parametrize("shared", [False, True])
def test_exact_subkey_scores_equal_the_einsum_and_its_gradient(shared):
    """memlm.memory.fast.exact: the scores with TF32 off (a custom op) are the
    einsum's, and its backward is autograd's through the einsum (float64)."""
    q, keys = _inputs(shared=shared, seed=5)
    got, want = exact_subkey_scores(q, keys), subkey_scores(q, keys)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    probe = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for g, w in zip(torch.autograd.grad((got * probe).sum(), (q, keys)),
                    torch.autograd.grad((want * probe).sum(), (q, keys))):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    small = _inputs(tokens=3, heads=2, n_keys=5, half=3, shared=shared, seed=6)
    assert torch.autograd.gradcheck(exact_subkey_scores, small)


def test_exact_linear_equals_f_linear_and_its_gradient():
    gen = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
               for shape in ((6, 5), (4, 5), (4,)))
    torch.testing.assert_close(exact_linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=0, atol=0)
    assert torch.autograd.gradcheck(exact_linear, (x, w, b))
    with pytest.raises(ValueError, match="one floating dtype.*torch.float32, torch.float64"):
        exact_linear(x.float(), w, b)
    with pytest.raises(ValueError, match=r"x \(T, in\).*\(6, 5\), \(5, 4\)"):
        exact_linear(x, w.t(), b)
