"""MoE FFN (kind "moe"): routing, no token dropping, balance loss, accounting, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.model import Transformer
from memlm.model.moe import DENSE, GROUPED, MoE, expert_counts, expert_path


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
def test_grouped_experts_equal_the_dense_experts(skewed):
    """The grouped GEMM path (float32 on CPU) against the dense one (every
    expert on every token), same routing: outputs and every gradient."""
    moe = _moe(hidden=12).float()
    x = torch.randn(2, 9, 8, requires_grad=True)
    if skewed:  # most experts get no token: empty groups
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[3] = 4.0
            moe.router.weight[1] = 2.0
        x = (torch.rand(2, 9, 8) + 0.1).requires_grad_()
    assert expert_path(x.device, x.dtype, moe.dim, moe.hidden_dim) == GROUPED
    probe = torch.randn(2, 9, 8)

    def run(path):
        flat = x.reshape(-1, 8)
        _, gates, experts = moe.route(flat)
        if path == GROUPED:
            return moe.experts_grouped(flat, gates, experts, expert_counts(experts.reshape(-1), 5)).reshape(2, 9, 8)
        return moe.experts_dense(flat, gates, experts).reshape(2, 9, 8)

    out, ref = run(GROUPED), run(DENSE)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(moe(x), out)  # forward takes the grouped path here
    for got, want in zip(_grads(moe, x, out, probe), _grads(moe, x, ref, probe)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Against the per-token reference too (float32 rounding only).
    torch.testing.assert_close(out.double(),
                               _reference(moe.double(), x.detach().double().reshape(-1, 8)).reshape(2, 9, 8),
                               rtol=1e-5, atol=1e-5)


def test_expert_counts_is_a_fixed_size_count():
    experts = torch.tensor([3, 0, 3, 3, 1])
    assert expert_counts(experts, 5).tolist() == [1, 1, 0, 3, 0]
    assert expert_counts(torch.empty(0, dtype=torch.int64), 3).tolist() == [0, 0, 0]
    # Its shape does not depend on the data: it runs on meta (torch.bincount has no meta kernel).
    assert expert_counts(torch.empty(7, dtype=torch.int64, device="meta"), 4).shape == (4,)


def _capability(monkeypatch, major):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, 0))


@pytest.mark.parametrize(
    ("device", "dtype", "dim", "hidden", "major", "want"),
    [
        ("cuda:0", torch.bfloat16, 4096, 7168, 9, GROUPED),  # H100 / H200: the CUTLASS grouped GEMM
        ("cuda", torch.bfloat16, 4096, 7168, 10, GROUPED),  # B200
        ("cuda:0", torch.bfloat16, 4096, 7168, 8, DENSE),  # A100: torch's fallback reads offsets on the host
        ("cuda:0", torch.float32, 4096, 7168, 9, DENSE),  # fp32 on CUDA: the same fallback
        ("cuda:0", torch.bfloat16, 4096, 7164, 9, DENSE),  # hidden rows not 16-byte aligned
        ("meta", torch.bfloat16, 4096, 7168, None, GROUPED),
        ("meta", torch.float32, 4096, 7168, None, DENSE),  # meta (fake) kernel: bf16 only
        ("cpu", torch.bfloat16, 64, 96, None, GROUPED),
        ("cpu", torch.float32, 64, 96, None, GROUPED),  # eager only (see the compiled test)
        ("cpu", torch.float64, 64, 96, None, DENSE),
        ("cpu", torch.float32, 8, 10, None, DENSE),  # 40-byte rows
    ],
)
def test_expert_path_rules(monkeypatch, device, dtype, dim, hidden, major, want):
    if major is not None:
        _capability(monkeypatch, major)
    assert expert_path(torch.device(device), dtype, dim, hidden) == want


def test_expert_path_without_grouped_mm_in_torch(monkeypatch):
    monkeypatch.delattr(F, "grouped_mm")
    monkeypatch.delattr(torch, "_grouped_mm")
    _capability(monkeypatch, 9)
    assert expert_path(torch.device("cuda", 0), torch.bfloat16, 4096, 7168) == DENSE
    assert expert_path(torch.device("cpu"), torch.bfloat16, 64, 96) == DENSE


def _spy_paths(monkeypatch) -> list[tuple]:
    """Record (path, dtype of the matmuls' input) for every MoE forward."""
    calls = []
    grouped, dense = MoE.experts_grouped, MoE.experts_dense

    def spy_grouped(self, x, *args):
        calls.append((GROUPED, x.dtype))
        return grouped(self, x, *args)

    def spy_dense(self, x, *args):
        calls.append((DENSE, x.dtype))
        return dense(self, x, *args)

    monkeypatch.setattr(MoE, "experts_grouped", spy_grouped)
    monkeypatch.setattr(MoE, "experts_dense", spy_dense)
    return calls


def test_autocast_bf16_runs_the_grouped_experts_in_bf16(monkeypatch):
    """Single-process bf16 training: float32 residual stream into the layer
    under autocast. The experts run as grouped GEMMs on bf16 inputs, the one
    dtype torch's CUDA grouped GEMM kernel takes; the output stays float32.
    The same dtype on an sm90 GPU selects the same path."""
    moe = _moe(dim=64, hidden=96, n_experts=8, top_k=2).float()
    x = torch.randn(3, 5, 64)
    calls = _spy_paths(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert calls == [(GROUPED, torch.bfloat16)]
    assert out.dtype == torch.float32
    ref = moe(x)  # float32, no autocast: the grouped path in float32
    assert calls[-1] == (GROUPED, torch.float32)
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    _capability(monkeypatch, 9)
    assert expert_path(torch.device("cuda", 0), calls[0][1], 64, 96) == GROUPED
    # Before: the routed input stayed float32 under autocast, and float32 on CUDA is not grouped.
    assert expert_path(torch.device("cuda", 0), torch.float32, 64, 96) == DENSE


# Ops whose output size depends on the data or that read a value on the host:
# each is a device sync on CUDA and a graph break (or a failure) under torch.compile.
_SYNCING_OPS = {"bincount", "nonzero", "_local_scalar_dense", "unique", "_unique", "_unique2",
                "unique_consecutive", "masked_select", "repeat_interleave", "item"}


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast_bf16_grouped", "fp64_dense"])
def test_forward_and_backward_run_no_syncing_op(autocast):
    """Every aten op of a forward + backward (both paths: grouped under
    autocast bf16, dense in float64) is recorded; none has a data-dependent
    output size or reads a value. The old torch.bincount count fails this."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    moe = _moe(dim=64, hidden=96, n_experts=8, top_k=2, coef=0.01)
    if autocast:
        moe = moe.float()
    x = torch.randn(2, 6, 64, dtype=torch.float32 if autocast else torch.float64, requires_grad=True)
    with Ops() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = moe(x)
        (out.square().sum() + moe.last_aux_loss).backward()
    assert not _SYNCING_OPS & set(ops.seen), sorted(_SYNCING_OPS & set(ops.seen))
    assert "scatter_add_" in ops.seen or "scatter_add" in ops.seen  # the count
    if autocast:  # 3 projections forward, and their backward
        assert ops.seen.count("_grouped_mm") > 3
    else:
        assert "_grouped_mm" not in ops.seen and "bmm" in ops.seen
    assert x.grad is not None and moe.w2.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["autocast_bf16", "fp32"])
def test_compiled_moe_block_has_no_graph_break_or_recompile(dtype):
    """A Transformer block with the MoE FFN compiled whole (fullgraph, the
    aot_eager backend: dynamo's graphs, forward and backward, without
    inductor's C++ compile) under autocast bf16, and in float32 (there the
    traced path is the dense one: the grouped GEMM's fake kernel is
    bf16-only). A second batch with other routing reuses the graph; loss and
    gradients equal eager."""
    import copy

    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, cfg = _tiny(["memory=moe", "memory.spread=0", "model.n_layers=2", "memory.layers=[1]",
                        "model.vocab_size=64"])
    eager = copy.deepcopy(model)
    assert isinstance(model.layers[1].feed_forward, MoE)
    graphs = []

    def backend(gm, example_inputs):  # aot_eager, keeping each graph dynamo captured
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    model.layers[1].compile(backend=backend, fullgraph=True)  # fullgraph: a graph break would raise
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        results = []
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = F.cross_entropy(m(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
                loss = loss + m.aux_loss()
            loss.backward()
            results.append((loss.detach(), [p.grad for p in m.parameters()]))
        (loss_c, grads_c), (loss_e, grads_e) = results
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(loss_c, loss_e, rtol=tol, atol=tol)
        for c, e in zip(grads_c, grads_e):
            torch.testing.assert_close(c, e, rtol=tol, atol=tol)
    assert len(graphs) == 1  # one graph, compiled once for both batches
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # The path in the graph: grouped GEMMs under autocast bf16, the dense bmm in float32.
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    grouped = sum("grouped_mm" in t for t in targets)
    assert grouped == (3 if dtype == torch.bfloat16 else 0), targets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_8b_moe_forward_and_backward_on_meta(monkeypatch, dtype):
    """The 8b preset with memory=moe, built on the meta device: forward,
    loss with the balance loss, backward. Every shape is checked by the meta
    kernels without memory or a host read (bincount had no meta kernel);
    bf16 takes the grouped GEMMs of a GPU, float32 the dense experts."""
    cfg = compose(["model=8b", "memory=moe"])
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    model = model.to(dtype)
    moes = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, MoE)]
    assert len(moes) == 3 and moes[0].dim == 4096 and moes[0].hidden_dim == 7168
    calls = _spy_paths(monkeypatch)
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    logits = model(tokens)
    assert logits.shape == (2, 32, cfg.model.vocab_size)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + model.aux_loss()
    loss.backward()
    assert calls == [(GROUPED if dtype == torch.bfloat16 else DENSE, dtype)] * 3
    for moe in moes:
        for w in (moe.w1, moe.w3, moe.w2, moe.router.weight):
            assert w.grad is not None and w.grad.shape == w.shape and w.grad.device.type == "meta"


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
