"""Memory and MemoryPlus against the plain reference math (memory/reference.py, every slot scored, float64)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from memlm.memory import Memory, MemoryPlus, ValuePool, value_parameters
from memlm.memory.reference import reference_forward

SIZES = dict(n_keys=6, heads=2, knn=3, k_dim=6)


def _layer(cls, dim=8, seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = cls(dim, **{**SIZES, **kwargs}).double()
    layer.init_weights()
    with torch.no_grad():  # spread the sub-keys so that no two slot scores nearly tie
        layer.lookup.keys.mul_(5.0)
        for name, p in layer.named_parameters():  # biases away from their zero init, so that each counts
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return layer


CASES = [
    (Memory, {}),
    (Memory, {"v_dim": 10}),  # output projection
    (MemoryPlus, {"gate": "swilu"}),
    (MemoryPlus, {"gate": "sigmoid", "v_dim": 12}),
    (MemoryPlus, {"gate": "none", "qk_norm": False}),
    (MemoryPlus, {"gate": "swilu", "bias": True}),  # memory.w_bias
    (MemoryPlus, {"gate": "sigmoid", "v_dim": 12, "bias": True}),
]


@pytest.mark.parametrize("cls,kwargs", CASES)
def test_output_and_gradients_equal_the_reference(cls, kwargs):
    layer = _layer(cls, **kwargs)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    ref = reference_forward(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(out, [x, *params], g)
    ref_grads = torch.autograd.grad(ref, [x, *params], g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls,kwargs", [(Memory, {"v_dim": 4}), (MemoryPlus, {"qk_norm": True}),
                                        (MemoryPlus, {"bias": True})])
def test_gradcheck(cls, kwargs):
    layer = _layer(cls, dim=4, **kwargs)
    names = [n for n, _ in layer.named_parameters()]
    tensors = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def fn(x, *ps):
        return functional_call(layer, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *tensors), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_eval_uses_eval_knn():
    layer = _layer(MemoryPlus, knn=2, eval_knn=5)
    x = torch.randn(4, 8, dtype=torch.float64)
    layer.eval()
    torch.testing.assert_close(layer(x), reference_forward(layer, x))
    layer.usage.reset()
    layer(x)  # eval reads are not counted in the training window
    assert int(layer.usage.counts.sum()) == 0
    layer.train()
    layer(x)
    assert int(layer.usage.counts.sum()) == 4 * 2 * 2  # tokens * heads * knn
    layer.knn = 4  # by hand (the knn schedule uses set_knn)
    torch.testing.assert_close(layer(x), reference_forward(layer, x))
    with pytest.raises(ValueError, match="knn=37 is invalid"):
        layer.knn = 37  # more than n_keys


def test_shared_pool_is_held_once_and_reads_are_counted():
    pool = ValuePool(36, 8)
    layers = torch.nn.ModuleList([MemoryPlus(8, **SIZES, values=pool) for _ in range(3)])
    assert len(list(layers.parameters())) == 3 * 5  # query w+b, keys, w1, w2 (no table)
    assert not any("values" in k for k in layers.state_dict())
    model = torch.nn.Module()
    model.pool, model.layers = pool, layers  # the pool registered once, on a common parent (docs/memory.md)
    assert value_parameters(model) == [pool.weight]
    assert pool.reads_per_token == 3 * 2 * 3
    assert pool.inactive_params() == (36 - 18) * 8
    with pytest.raises(ValueError, match="shared value pool"):
        MemoryPlus(8, **{**SIZES, "n_keys": 5}, values=pool)


def test_flops_per_token_by_hand():
    layer = MemoryPlus(16, n_keys=32, heads=4, knn=8, k_dim=10, v_dim=24)
    query = 2 * 16 * 4 * 10
    scoring = 4 * 2 * 32 * 5 * 2
    candidates = 4 * 8 * 8
    rows = 2 * 4 * 8 * 24
    gate_and_out = 2 * 16 * 24 * 2
    assert layer.flops_per_token() == query + scoring + candidates + rows + gate_and_out
    plain = Memory(16, n_keys=32, heads=4, knn=8, k_dim=10)
    assert plain.flops_per_token() == query + scoring + candidates + 2 * 4 * 8 * 16


@torch.no_grad()
def test_published_init():
    torch.manual_seed(0)
    layer = MemoryPlus(256, n_keys=64, heads=2, knn=4, k_dim=128, v_dim=192)
    bound = 128**-0.5
    keys = layer.lookup.keys
    assert float(keys.abs().max()) <= bound and float(keys.abs().max()) > 0.9 * bound
    table = layer.values.weight
    assert float(table.std()) == pytest.approx(192**-0.5, rel=0.02)
    for lin in (layer.w1, layer.w2):
        assert float(lin.weight.std()) == pytest.approx(256**-0.5, rel=0.05)
    q = layer.lookup.query.weight  # xavier-uniform: bound sqrt(6 / (fan_in + fan_out))
    assert float(q.abs().max()) <= (6 / (256 + 2 * 128)) ** 0.5
    assert float(layer.lookup.query.bias.abs().max()) == 0.0
    # Built on meta, then materialized: init_weights() gives the same statistics.
    with torch.device("meta"):
        meta = MemoryPlus(256, n_keys=64, heads=2, knn=4, k_dim=128, v_dim=192)
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert float(meta.values.weight.std()) == pytest.approx(192**-0.5, rel=0.02)


def test_the_bias_switch_adds_exactly_w1_and_w2_biases_starting_at_zero():
    """Off (the default), the layer's tensors are those it had before the switch; on, two more."""
    names = {"lookup.query.weight", "lookup.query.bias", "lookup.keys", "values.weight",
             "w1.weight", "w2.weight"}
    assert set(MemoryPlus(16, **SIZES).state_dict()) == names
    assert set(MemoryPlus(16, **SIZES, gate="none").state_dict()) == names - {"w1.weight"}
    biased = MemoryPlus(16, **SIZES, v_dim=12, bias=True)
    assert set(biased.state_dict()) == names | {"w1.bias", "w2.bias"}
    assert biased.w1.bias.shape == (12,) and biased.w2.bias.shape == (16,)
    with torch.no_grad():
        biased.w1.bias.fill_(1.0)
        biased.w2.bias.fill_(1.0)
    biased.init_weights()
    assert float(biased.w1.bias.detach().abs().max()) == float(biased.w2.bias.detach().abs().max()) == 0.0
    # The bias flops (dim + v_dim adds) are not counted, as the query's bias is not.
    assert biased.flops_per_token() == MemoryPlus(16, **SIZES, v_dim=12).flops_per_token()


@torch.no_grad()
def test_value_init_scale_scales_the_published_std():
    torch.manual_seed(0)
    small = Memory(32, n_keys=32, heads=2, knn=4, k_dim=8, v_dim=64, value_init_scale=0.1)
    assert float(small.values.weight.std()) == pytest.approx(0.1 * 64**-0.5, rel=0.05)
    zero = ValuePool(16, 8, init_scale=0.0)
    assert float(zero.weight.abs().max()) == 0.0
    zero.weight.fill_(1.0)
    zero.init_weights()  # re-init (after to_empty) keeps the pool's scale
    assert float(zero.weight.abs().max()) == 0.0
    with pytest.raises(ValueError, match="init_scale"):
        ValuePool(16, 8, init_scale=-1.0)


def test_value_init_scale_reaches_the_shared_pool():
    from memlm.config.run import compose
    from memlm.model.build import build_model

    cfg = compose(["model=tiny", "memory=memplus", "memory.layers=[0,1]", "memory.n_keys=8", "memory.knn=4",
                   "memory.eval_knn=4", "memory.k_dim=8", "memory.value_init_scale=0"])
    model = build_model(cfg.model, cfg.memory)
    pools = [m for m in model.modules() if isinstance(m, ValuePool)]
    assert len(pools) == 1 and float(pools[0].weight.detach().abs().max()) == 0.0


def test_pool_reader_hook_replaces_the_local_read():
    """Memory parallelism installs `pool.reader`; the layer must go through it."""
    layer = _layer(MemoryPlus)
    calls = []

    def reader(pool, indices, weights, sparse, kernel, launches):
        calls.append((indices.shape, sparse, kernel, launches))
        return torch.zeros(indices.shape[0], pool.v_dim, dtype=pool.weight.dtype)

    layer.values.reader = reader
    out = layer(torch.randn(3, 8, dtype=torch.float64))
    # The config values: the kernel resolved per call by device, the launches as configured.
    assert calls == [(torch.Size([3, 2 * 3]), False, "auto", ((), ()))]
    assert torch.equal(out, torch.zeros_like(out))  # W2(0 * gate) = 0


def test_under_torch_compile_the_layer_is_one_graph():
    """The search and the read are custom ops (opaque to the compiler) and
    the usage count is a traced buffer update: torch.compile captures the
    whole layer in one graph (it was 4, split at every memory kernel), with
    the same outputs and gradients as eager."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MemoryPlus(dim=16, n_keys=8, heads=2, knn=4, k_dim=8, qk_norm=True)
    x = torch.randn(3, 5, 16, requires_grad=True)
    ref = layer(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    assert counter.frame_count == 1
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
