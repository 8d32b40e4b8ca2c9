"""PEER FFN (kind "peer"): the exact top-k, memlm's PEER vs the exported one, accounting, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.hf.remote import experts_memlm
from memlm.hf.remote.experts_memlm import PEER as RemotePEER
from memlm.memory import reference as ref
from memlm.memory.fast.row_dots import row_dots
from memlm.model import Transformer
from memlm.model.peer import PEER


def _peer(query_norm=False, activation="gelu", dim=8, n_keys=6, heads=3, knn=4, k_dim=6) -> PEER:
    torch.manual_seed(0)
    peer = PEER(dim, n_keys, heads, knn, k_dim, query_norm=query_norm, activation=activation).double()
    # Query wider than the model init, so the softmax over kept scores is not flat.
    peer.init_weights(0.5, 0.3)
    return peer


def test_knn_equal_to_n_keys_reads_the_global_top_k():
    # knn = n_keys: every sub-key survives the first stage; still the exact top-k
    # (memory/reference.py scores all N experts; tests/unit/test_memory_reference.py
    # checks PEER's retrieval, output and gradients against it in general).
    peer = _peer(n_keys=4, knn=4, heads=1)
    x = torch.randn(6, 8, dtype=torch.float64)
    with torch.no_grad():
        _, idx = peer.retrieve(x)
        _, want = ref.peer_retrieve(x, peer)
    assert torch.equal(idx.sort(dim=-1).values, want.sort(dim=-1).values)


# ------------------------------------------- memlm's PEER vs the exported one
def _float32_twins(query_norm: bool, activation: str) -> tuple[PEER, RemotePEER]:
    """memlm's PEER and the remote one (hf/remote/experts_memlm.py) with its weights, float32."""
    torch.manual_seed(0)
    peer = PEER(32, 16, 2, 8, 16, query_norm=query_norm, activation=activation)
    peer.init_weights(0.5, 0.3)
    m = dict(n_keys=16, heads=2, knn=8, k_dim=16, qk_norm=query_norm, peer_activation=activation)
    remote = RemotePEER(32, m)
    remote.load_state_dict(peer.state_dict())
    return peer, remote


def _sorted(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's (weight, expert) pairs in expert order (memlm's search is unordered)."""
    idx, order = idx.sort(dim=-1)
    return weights.gather(-1, order), idx


CASES = [(False, "gelu"), (True, "gelu"), (False, "silu"), (True, "silu")]


@pytest.mark.parametrize(("query_norm", "activation"), CASES)
def test_the_remote_peer_equals_memlm_but_for_the_order_of_its_dots(monkeypatch, query_norm, activation):
    """float32 on CPU: the same experts and weights bit for bit; the outputs
    differ by the summation order of the u_i . x dots alone (memlm's row_dots
    takes BLAS dots, the remote a batched matmul): with memlm's row_dots in the
    remote, `==`."""
    peer, remote = _float32_twins(query_norm, activation)
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = _sorted(*peer.retrieve(x.view(-1, 32))), _sorted(*remote.retrieve(x.view(-1, 32)))
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        out = peer(x)
        # Measured: at most 2.7e-7 over 20 seeds at these sizes (outputs ~0.5: a few float32 ulp).
        assert (out - remote(x)).abs().max().item() <= 3e-7
        monkeypatch.setattr(experts_memlm, "row_dots", row_dots)
        assert torch.equal(out, remote(x))


def test_the_remote_peer_selects_in_float32_under_autocast(monkeypatch):
    """Under autocast(bf16) the remote PEER projects its query in float32, as
    memlm's does: with memlm's dots (see above), the two are equal bit for bit.
    (The remote before, with its query and dots in bf16, was 5e-2 off here.)"""
    peer, remote = _float32_twins(True, "gelu")
    monkeypatch.setattr(experts_memlm, "row_dots", row_dots)
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, plain_retrieved = remote(x), remote.retrieve(x.view(-1, 32))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, want, retrieved = remote(x), peer(x), remote.retrieve(x.view(-1, 32))
    assert retrieved[0].dtype == torch.float32
    assert torch.equal(retrieved[0], plain_retrieved[0]) and torch.equal(retrieved[1], plain_retrieved[1])
    assert torch.equal(out, want)
    assert torch.equal(out, plain)


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
