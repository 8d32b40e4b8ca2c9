"""MoE FFN (kind "moe"): routing, no token dropping, balance loss, accounting, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.errors import ConfigError
from memlm.model import Transformer
from memlm.model.moe import MoE
from memlm.train.config import compose


def _moe(dim=8, hidden=12, n_experts=5, top_k=2, coef=0.0, seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dim, hidden, n_experts, top_k, coef).double()
    # Wider than the model init so routing probabilities are far from uniform.
    moe.init_weights(0.5, 0.3)
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token, loop over its top_k experts with explicitly computed weights."""
    # x: (T, dim) -> (T, dim)
    out = []
    for t in range(x.shape[0]):
        probs = torch.softmax(moe.router.weight @ x[t], dim=0)  # (E,)
        chosen = torch.argsort(probs, descending=True)[: moe.top_k]
        total = sum(probs[e] for e in chosen)
        y = torch.zeros_like(x[t])
        for e in chosen.tolist():
            h = F.silu(x[t] @ moe.w1[e]) * (x[t] @ moe.w3[e])
            y = y + (probs[e] / total) * (h @ moe.w2[e])
        out.append(y)
    return torch.stack(out)


def _grads(moe: MoE, x: torch.Tensor, out: torch.Tensor, probe: torch.Tensor) -> list[torch.Tensor]:
    params = [x, moe.router.weight, moe.w1, moe.w2, moe.w3]
    return torch.autograd.grad((out * probe).sum(), params)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_matches_loop_reference_outputs_and_gradients(top_k):
    moe = _moe(top_k=top_k)
    x = torch.randn(2, 7, 8, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 7, 8, dtype=torch.float64)
    out = moe(x)
    ref = _reference(moe, x.reshape(-1, 8)).reshape(2, 7, 8)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(moe, x, out, probe), _grads(moe, x, ref, probe)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("skewed", [False, True])
def test_grouped_experts_equal_the_per_expert_loop(skewed):
    """The sync-free grouped GEMM path (float32 on CPU) against the loop that
    reads the per-expert counts on the host: outputs and every gradient."""
    moe = _moe(hidden=12).float()
    x = torch.randn(2, 9, 8, requires_grad=True)
    if skewed:  # most experts get no token: empty groups
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[3] = 4.0
            moe.router.weight[1] = 2.0
        x = (torch.rand(2, 9, 8) + 0.1).requires_grad_()
    assert moe.grouped_mm_applies(x)
    probe = torch.randn(2, 9, 8)
    out = moe(x)
    loop = MoE.experts_grouped
    try:
        MoE.experts_grouped = MoE.experts_loop  # the old formulation, same routing
        ref = moe(x)
    finally:
        MoE.experts_grouped = loop
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(_grads(moe, x, out, probe), _grads(moe, x, ref, probe)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Against the per-token reference too (float32 rounding only).
    torch.testing.assert_close(out.double(), _reference(moe.double(), x.detach().double().reshape(-1, 8)).reshape(2, 9, 8),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2])
def test_no_token_dropped_when_every_token_routes_to_the_same_experts(top_k):
    moe = _moe(top_k=top_k)
    x = torch.rand(40, 8, dtype=torch.float64) + 0.1  # positive inputs
    with torch.no_grad():
        # Logit of expert 0 (and 1) >> every other: all 40 tokens pick them.
        moe.router.weight.zero_()
        moe.router.weight[0] = 10.0
        moe.router.weight[1] = 5.0
    _, _, experts = moe.route(x)
    assert set(experts.reshape(-1).tolist()) == set(range(top_k))
    out = moe(x)
    ref = _reference(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert (out.abs().sum(dim=-1) > 0).all(), "a token got no expert output"
    if top_k == 1:
        # Gate renormalized over one expert is exactly 1: output = expert 0.
        h = F.silu(x @ moe.w1[0]) * (x @ moe.w3[0])
        torch.testing.assert_close(out, h @ moe.w2[0], rtol=1e-12, atol=1e-12)


def test_balance_loss_equals_its_formula():
    coef, n_experts, top_k = 0.01, 5, 2
    moe = _moe(n_experts=n_experts, top_k=top_k, coef=coef)
    x = torch.randn(3, 11, 8, dtype=torch.float64)
    moe(x)
    flat = x.reshape(-1, 8)
    probs = torch.softmax(flat @ moe.router.weight.t(), dim=-1)  # (T, E)
    assigned = torch.zeros(n_experts, dtype=torch.float64)
    for t in range(flat.shape[0]):
        for e in torch.argsort(probs[t], descending=True)[:top_k].tolist():
            assigned[e] += 1
    f = assigned / (flat.shape[0] * top_k)
    p = probs.mean(dim=0)
    expected = coef * n_experts * (f * p).sum()
    torch.testing.assert_close(moe.last_aux_loss, expected, rtol=1e-12, atol=1e-15)
    # Differentiable through the mean probabilities: the router learns from it.
    (grad,) = torch.autograd.grad(moe.last_aux_loss, moe.router.weight)
    assert grad.abs().sum() > 0


def test_balance_loss_off_when_coef_is_zero():
    moe = _moe(coef=0.0)
    moe(torch.randn(4, 8, dtype=torch.float64))
    assert moe.last_aux_loss is None


def test_flops_and_inactive_params_small_config():
    moe = MoE(dim=16, hidden_dim=32, n_experts=4, top_k=2)
    expert = 3 * 16 * 32  # w1, w3, w2 = 1536
    assert moe.expert_params() == expert
    # Router 2*16*4 = 128, plus 2 experts x 2 FLOPs x 1536 = 6144.
    assert moe.flops_per_token() == 6272
    assert moe.inactive_params() == 2 * expert == 3072


def _tiny(overrides):
    cfg = compose(["model=tiny", *overrides])
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model, cfg


def test_default_expert_size_is_compute_matched_and_counts_add_up():
    model, cfg = _tiny(["memory=moe", "memory.layers=[1]", "memory.spread=0"])
    dense, moe = model.layers[0].feed_forward, model.layers[1].feed_forward
    assert isinstance(moe, MoE)
    assert moe.hidden_dim == cfg.model.hidden_dim // 2  # 192 // top_k=2
    # Same expert FLOPs as the dense SwiGLU; the router is the only extra.
    assert moe.flops_per_token() == dense.flops_per_token() + 2 * cfg.model.dim * 8
    counts = model.num_params()
    assert counts["total"] - counts["active"] == 6 * moe.expert_params()


def test_tiny_moe_model_trains_and_reports_aux_loss():
    model, cfg = _tiny(["memory=moe", "memory.spread=1"])
    moes = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, MoE)]
    assert len(moes) == 1
    initial = [moe.w1.detach().clone() for moe in moes]
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(tokens[:, :-1])
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        aux = model.aux_loss()
        assert aux is not None and aux.ndim == 0
        opt.zero_grad()
        (lm + aux).backward()
        opt.step()
        losses.append(lm.item())
    assert losses[-1] < 0.5 * losses[0], losses
    # The experts and the router themselves were trained, not only attention.
    assert all((moe.w1 != w1).any() for moe, w1 in zip(moes, initial))
    assert all(moe.router.weight.grad.abs().sum() > 0 for moe in moes)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("memory.top_k=9", "memory.top_k"),
        ("memory.top_k=0", "memory.top_k"),
        ("memory.n_experts=0", "memory.n_experts"),
        ("memory.expert_hidden_dim=-1", "memory.expert_hidden_dim"),
    ],
)
def test_bad_values_fail_at_compose(override, key):
    with pytest.raises(ConfigError) as err:
        compose(["memory=moe", "memory.spread=1", override])
    assert err.value.key == key
    assert key in str(err.value)
