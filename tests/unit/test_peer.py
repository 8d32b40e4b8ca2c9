"""PEER FFN (kind "peer"): product-key retrieval vs brute force, accounting, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.model import Transformer
from memlm.model.peer import PEER


def _peer(query_norm=False, activation="gelu", dim=8, n_keys=6, heads=3, knn=4, k_dim=6) -> PEER:
    torch.manual_seed(0)
    peer = PEER(dim, n_keys, heads, knn, k_dim, query_norm=query_norm, activation=activation).double()
    # Query wider than the model init, so the softmax over kept scores is not flat.
    peer.init_weights(0.5, 0.3)
    return peer


def _reference(peer: PEER, x: torch.Tensor) -> tuple[torch.Tensor, list[set[int]]]:
    """Per token, per head: brute-force top-k over all N summed scores, explicit sum."""
    # x: (T, dim) -> (T, dim), and the chosen expert set of each (token, head).
    act = {"gelu": F.gelu, "silu": F.silu}[peer.activation]
    half, n = peer.k_dim // 2, peer.n_keys
    out, chosen = [], []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for h in range(peer.heads):
            q = peer.query.weight[h * peer.k_dim:(h + 1) * peer.k_dim] @ x[t]  # (k_dim,)
            q1, q2 = q[:half], q[half:]
            if peer.query_norm:
                q1 = q1 / (q1.pow(2).mean() + torch.finfo(q.dtype).eps).sqrt()
                q2 = q2 / (q2.pow(2).mean() + torch.finfo(q.dtype).eps).sqrt()
            # All N = n*n experts: score of expert i*n + j is q1.keys0[i] + q2.keys1[j].
            scores = torch.stack([q1 @ peer.keys[0, e // n] + q2 @ peer.keys[1, e % n] for e in range(n * n)])
            top = torch.argsort(scores, descending=True)[: peer.knn]
            w = torch.softmax(scores[top], dim=0)
            chosen.append(set(top.tolist()))
            for wt, e in zip(w, top.tolist()):
                y = y + wt * act(peer.experts.down[e] @ x[t]) * peer.experts.up[e]
        out.append(y)
    return torch.stack(out), chosen


@pytest.mark.parametrize(("query_norm", "activation"), [(False, "gelu"), (True, "gelu"), (False, "silu")])
def test_matches_brute_force_reference_outputs_and_gradients(query_norm, activation):
    peer = _peer(query_norm, activation)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 5, 8, dtype=torch.float64)
    out = peer(x)
    ref, chosen = _reference(peer, x.reshape(-1, 8))
    ref = ref.reshape(2, 5, 8)
    _, idx = peer.retrieve(x.reshape(-1, 8))
    assert [set(i.tolist()) for i in idx.reshape(-1, peer.knn)] == chosen
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    params = [x, peer.query.weight, peer.keys, peer.experts.down, peer.experts.up]
    got = torch.autograd.grad((out * probe).sum(), params)
    want = torch.autograd.grad((ref * probe).sum(), params)
    for name, g, w in zip(["x", "query", "keys", "down", "up"], got, want):
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_knn_equal_to_n_keys_reads_the_global_top_k():
    # knn = n_keys: every sub-key survives the first stage; still the exact top-k.
    peer = _peer(n_keys=4, knn=4, heads=1)
    x = torch.randn(6, 8, dtype=torch.float64)
    _, idx = peer.retrieve(x)
    _, chosen = _reference(peer, x)
    assert [set(i.tolist()) for i in idx.reshape(-1, 4)] == chosen


def test_flops_and_inactive_params_small_config():
    peer = PEER(dim=16, n_keys=8, heads=2, knn=3, k_dim=8)
    # query 2*16*(2*8) = 512; scoring 2 heads x 2 halves x 8 keys x 4 x 2 = 256;
    # experts 2 heads x 3 rows x (16-dot for u + 16-axpy for v) x 2 = 384.
    assert peer.flops_per_token() == 512 + 256 + 384
    # 64 experts, 6 read per token: 58 rows of u and of v, 16 wide, untouched.
    assert peer.inactive_params() == 2 * 58 * 16


def _tiny(overrides):
    cfg = compose(["model=tiny", *overrides])
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model, cfg


PEER_TINY = ["memory=peer", "memory.spread=1", "memory.n_keys=16", "memory.heads=2",
             "memory.knn=4", "memory.k_dim=16", "memory.eval_knn=4"]


def test_tiny_model_counts_expert_tables_as_memory():
    model, cfg = _tiny(PEER_TINY)
    peers = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, PEER)]
    assert len(peers) == 1
    counts = model.num_params()
    assert counts["memory"] == 2 * 256 * cfg.model.dim
    assert counts["total"] - counts["active"] == 2 * (256 - 8) * cfg.model.dim


def test_tiny_peer_model_trains():
    model, cfg = _tiny(PEER_TINY)
    peer = next(b.feed_forward for b in model.layers if isinstance(b.feed_forward, PEER))
    up0 = peer.experts.up.detach().clone()
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        assert model.aux_loss() is None  # PEER has no auxiliary loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    # The expert table itself was trained (rows that were read moved).
    assert (peer.experts.up != up0).any(dim=-1).sum() > 0
    assert peer.keys.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("memory.knn=17", "memory.knn"),
        ("memory.knn=0", "memory.knn"),
        ("memory.k_dim=15", "memory.k_dim"),
        ("memory.heads=0", "memory.heads"),
    ],
)
def test_bad_values_fail_at_compose(override, key):
    with pytest.raises(ConfigError) as err:
        compose([*PEER_TINY, override])
    assert err.value.key == key
    assert key in str(err.value)
