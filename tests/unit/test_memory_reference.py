"""memory/reference.py, the plain math, against the fast paths and the HF remote layers.

The reference scores every slot with its full key; the layers use the exact
sqrt(N) product-key search, custom ops and embedding-bag kernels; the remote
layers (hf/remote/modeling_memlm.py, shipped in exports) are a separate plain
re-implementation. All three must give the same slots and outputs: for the
memory layers and for PEER (its retrieval and its forward).
"""

from __future__ import annotations

import pytest
import torch

from memlm.hf.remote.experts_memlm import PEER as RemotePEER
from memlm.hf.remote.modeling_memlm import ProductKeyMemory as RemoteMemory
from memlm.memory import Memory, MemoryPlus, product_key_topk, subkey_scores
from memlm.memory import reference as ref
from memlm.model.peer import PEER

SIZES = dict(n_keys=6, heads=2, knn=3, k_dim=6)


def _memlm_layer(cls, dim=8, seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = cls(dim, **{**SIZES, **kwargs}).double()
    layer.init_weights()
    with torch.no_grad():  # spread the sub-keys (no near ties) and give the table values
        layer.lookup.keys.mul_(5.0)
        layer.values.weight.normal_()
    return layer


@pytest.mark.parametrize("n_keys,knn,heads", [(8, 1, 1), (16, 4, 2), (32, 32, 3), (50, 7, 4)])
def test_all_slot_search_equals_the_product_key_search(n_keys, knn, heads):
    gen = torch.Generator().manual_seed(n_keys * 100 + knn)
    q = torch.randn(40, heads, 2, 6, generator=gen, dtype=torch.float64)
    keys = torch.randn(heads, 2, n_keys, 6, generator=gen, dtype=torch.float64)
    scores, slots = product_key_topk(subkey_scores(q, keys), knn)
    full = ref.all_slot_scores(q, keys)
    assert full.shape == (40, heads, n_keys**2)
    ref_scores, ref_slots = full.topk(knn, dim=-1)
    assert torch.equal(slots, ref_slots)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-12, atol=1e-12)


def test_all_slot_scores_by_hand():
    q = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]], dtype=torch.float64)  # (T=1, H=1, 2, half=2)
    keys = torch.tensor([[[[1.0, 1.0], [3.0, 0.0]], [[0.0, 1.0], [5.0, 5.0]]]], dtype=torch.float64)  # (1, 2, 2, 2)
    # s1 = q1 . k1_i = (1, 3); s2 = q2 . k2_j = (2, 10); slot i*2 + j -> s1[i] + s2[j]
    assert ref.all_slot_scores(q, keys).flatten().tolist() == [3.0, 11.0, 5.0, 13.0]


CASES = [
    (Memory, {}),
    (Memory, {"v_dim": 10}),  # output projection
    (MemoryPlus, {"gate": "swilu"}),
    (MemoryPlus, {"gate": "swilu", "qk_norm": True}),
    (MemoryPlus, {"gate": "sigmoid", "v_dim": 12}),
    (MemoryPlus, {"gate": "none"}),
]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls,kwargs", CASES)
def test_memlm_layers_equal_the_reference(cls, kwargs, training):
    layer = _memlm_layer(cls, eval_knn=2, **kwargs).train(training)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out, want = layer(x), ref.reference_forward(layer, x)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    params = list(layer.parameters())
    for a, b in zip(torch.autograd.grad(out, [x, *params], g), torch.autograd.grad(want, [x, *params], g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _remote_twin(layer) -> RemoteMemory:
    """The remote layer with the memlm layer's settings and weights."""
    lk = layer.lookup
    m = dict(n_keys=lk.n_keys, heads=lk.heads, knn=lk.knn, eval_knn=lk.eval_knn, k_dim=lk.k_dim,
             v_dim=layer.v_dim, qk_norm=lk.qk_norm, gate=getattr(layer, "gate", "none"), value_dtype="fp32")
    remote = RemoteMemory(layer.dim, m, plus=isinstance(layer, MemoryPlus), pool=None).double()
    missing, unexpected = remote.load_state_dict(layer.state_dict(), strict=False)
    assert not missing, missing  # every remote weight comes from the memlm layer
    assert all(k.startswith("usage") for k in unexpected), unexpected  # training-only state
    remote.values.dtype = torch.float64
    return remote.train(layer.training)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls,kwargs", CASES)
def test_the_hf_remote_layer_equals_the_reference(cls, kwargs, training):
    layer = _memlm_layer(cls, eval_knn=2, **kwargs).train(training)
    remote = _remote_twin(layer)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(remote(x), ref.reference_forward(remote, x), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(remote(x), layer(x), rtol=1e-10, atol=1e-12)


def test_a_wrong_reference_is_caught():
    """The comparison can fail: a reference with the halves of the slot index
    swapped (slot j*n + i) disagrees with the layer."""
    layer = _memlm_layer(MemoryPlus).eval()
    x = torch.randn(4, 8, dtype=torch.float64)
    lk = layer.lookup
    swapped = ref.all_slot_scores(ref.query(x, lk).flip(2), lk.keys.flip(1))
    slots = lk(x, sub="none")[1].view(4, lk.heads, -1).sort(-1).values  # the layer's search is unordered
    right = ref.all_slot_scores(ref.query(x, lk), lk.keys).topk(lk.eval_knn, dim=-1).indices.sort(-1).values
    assert torch.equal(right, slots)
    assert not torch.equal(swapped.topk(lk.eval_knn, dim=-1).indices.sort(-1).values, slots)


# ---------------------------------------------------------------- PEER
PEER_CASES = [(False, "gelu"), (True, "gelu"), (False, "silu"), (True, "silu")]


def _peer(query_norm: bool, activation: str, dim=8, n_keys=6, heads=3, knn=4, k_dim=6) -> PEER:
    torch.manual_seed(0)
    peer = PEER(dim, n_keys, heads, knn, k_dim, query_norm=query_norm, activation=activation).double()
    peer.init_weights(0.5, 0.3)  # a query wider than the model's init: the softmax over kept scores is not flat
    return peer


def _remote_peer(peer: PEER) -> RemotePEER:
    """The remote PEER with memlm's PEER's settings and weights."""
    m = dict(n_keys=peer.n_keys, heads=peer.heads, knn=peer.knn, k_dim=peer.k_dim, qk_norm=peer.query_norm,
             peer_activation=peer.activation)
    remote = RemotePEER(peer.dim, m).double()
    remote.load_state_dict(peer.state_dict())  # strict: the same parameter names
    return remote


def _by_expert(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H, knn) weights and experts, each head's knn sorted by expert (memlm's search is unordered)."""
    experts, order = experts.sort(dim=-1)
    return weights.gather(-1, order), experts


@pytest.mark.parametrize("query_norm,activation", PEER_CASES)
def test_peer_retrieval_equals_the_reference(query_norm, activation):
    peer = _peer(query_norm, activation)
    remote = _remote_peer(peer)
    x = torch.randn(20, 8, dtype=torch.float64)
    with torch.no_grad():
        want_w, want_e = _by_expert(*ref.peer_retrieve(x, peer))
        for name, module in [("memlm", peer), ("remote", remote)]:
            w, e = _by_expert(*module.retrieve(x))
            assert torch.equal(e, want_e), name
            torch.testing.assert_close(w, want_w, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("query_norm,activation", PEER_CASES)
def test_peer_equals_the_reference_outputs_and_gradients(query_norm, activation):
    peer = _peer(query_norm, activation)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out, want = peer(x), ref.peer_forward(peer, x)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    params = [x, peer.query.weight, peer.keys, peer.experts.down, peer.experts.up]
    got, expected = torch.autograd.grad(out, params, g), torch.autograd.grad(want, params, g)
    for name, a, b in zip(["x", "query", "keys", "down", "up"], got, expected):
        assert a.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("query_norm,activation", PEER_CASES)
def test_the_hf_remote_peer_equals_the_reference(query_norm, activation):
    remote = _remote_peer(_peer(query_norm, activation))
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(remote(x), ref.peer_forward(remote, x), rtol=1e-10, atol=1e-12)


def test_the_peer_reference_has_peers_query_norm():
    """The comparison can fail: the memory layers' qk_norm (a query scaled by
    1/sqrt(half), unit-RMS keys) in place of PEER's own selects other experts."""
    peer = _peer(True, "gelu")
    x = torch.randn(20, 8, dtype=torch.float64)
    with torch.no_grad():
        _, experts = _by_expert(*peer.retrieve(x))
        _, right = _by_expert(*ref.peer_retrieve(x, peer))
        keys = peer.keys.expand(peer.heads, *peer.keys.shape)
        _, wrong = _by_expert(*ref.search(ref.query(x, peer), keys, peer.knn, qk_norm=True))
    assert torch.equal(right, experts)
    assert not torch.equal(wrong, experts)
