"""Memory layers inside memlm's Transformer: sharing, accounting, training, hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.config.run import compose
from memlm.memory import (
    SparseRowAdamW,
    apply_knn_schedule,
    usage_metrics,
    value_parameters,
)
from memlm.model import Transformer, build_model

# 16**2 = 256 slots, small enough for CPU tests.
SMALL = ["memory.n_keys=16", "memory.k_dim=16", "memory.heads=2", "memory.knn=4", "memory.eval_knn=4"]


def _cfg(preset="memplus", layers="[1]", *extra):
    return compose([f"memory={preset}", *SMALL, "memory.spread=0", f"memory.layers={layers}", *extra])


def _build(cfg, seed=0, dtype=torch.float32):
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model.to(dtype)


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def test_shared_pool_is_one_tensor_whose_gradient_sums_the_layers():
    three = ("model.n_layers=3", "memory.share_values=true")
    shared_cfg = _cfg("memplus", "[0,1,2]", *three)
    separate_cfg = _cfg("memplus", "[0,1,2]", "model.n_layers=3", "memory.share_values=false")
    shared = _build(shared_cfg, dtype=torch.float64)
    n_slots, dim = 16 * 16, shared_cfg.model.dim

    tables = [p for p in shared.parameters() if p.shape == (n_slots, dim)]
    assert len(tables) == 1
    table_keys = [k for k, t in shared.state_dict().items() if t.shape == (n_slots, dim)]
    assert table_keys == ["shared.memory_values.weight"]
    assert value_parameters(shared) == tables

    # The same weights, but each layer with its own copy of the table.
    separate = _build(separate_cfg, dtype=torch.float64)
    state = {}
    for key in separate.state_dict():
        state[key] = shared.state_dict()["shared.memory_values.weight" if "values.weight" in key else key]
    separate.load_state_dict(state)
    separate_tables = value_parameters(separate)
    assert len(separate_tables) == 3

    tokens = torch.randint(0, shared_cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    loss_shared, loss_separate = _lm_loss(shared, tokens), _lm_loss(separate, tokens)
    torch.testing.assert_close(loss_shared, loss_separate, rtol=1e-12, atol=1e-12)
    loss_shared.backward()
    loss_separate.backward()
    contributions = [t.grad for t in separate_tables]
    assert all(float(g.abs().sum()) > 0 for g in contributions)  # every layer contributes
    torch.testing.assert_close(tables[0].grad, sum(contributions), rtol=1e-10, atol=1e-13)


def test_parameter_accounting_of_a_shared_pool():
    cfg = compose(["model=373m", "memory=memplus"])
    assert cfg.memory.resolved_layers(24) == [4, 12, 20]
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    counts = model.num_params()
    n_slots, dim = 1024**2, 1024
    assert counts["memory"] == n_slots * dim  # counted once for three layers
    # A token reads 3 layers x 4 heads x 32 rows of the shared table.
    assert counts["total"] - counts["active"] == (n_slots - 3 * 4 * 32) * dim
    # FLOPs count the rows read, not the table.
    plain = compose(["model=373m"])
    with torch.device("meta"):
        dense = Transformer(plain.model, plain.memory)
    per_memory = model.layers[4].feed_forward.flops_per_token()
    per_dense = dense.layers[4].feed_forward.flops_per_token()
    assert model.flops_per_token(2048) == dense.flops_per_token(2048) + 3 * (per_memory - per_dense)
    assert per_memory < 10 * per_dense


@pytest.mark.parametrize("preset", ["pk", "memplus"])
def test_tiny_model_trains_and_reports_usage(preset):
    cfg = _cfg(preset, "[1]")
    model = _build(cfg, seed=0)
    model.train()
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    table = value_parameters(model)[0]
    start_table = table.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = _lm_loss(model, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    assert not torch.equal(table, start_table)  # the memory values were trained

    metrics = usage_metrics(model)
    prefix = "memory/layer1/"
    assert set(metrics) == {prefix + k for k in ("usage", "kl_uniform", "top1pct_share", "reads")}
    assert metrics[prefix + "reads"] == 30 * 4 * 32 * 2 * 4  # steps * tokens * heads * knn
    assert 0 < metrics[prefix + "usage"] <= 1
    assert 0 <= metrics[prefix + "kl_uniform"] <= torch.log(torch.tensor(256.0)).item()
    assert 0.01 - 1e-9 <= metrics[prefix + "top1pct_share"] <= 1
    assert usage_metrics(model) == {}  # the window was reset


def test_sparse_updates_train_with_lazy_adamw():
    cfg = _cfg("memplus", "[0,1]", "memory.sparse_updates=true")
    model = _build(cfg, seed=0)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(2))
    values = value_parameters(model)
    others = [p for p in model.parameters() if all(p is not v for v in values)]
    opts = [torch.optim.AdamW(others, lr=3e-3), SparseRowAdamW(values, lr=3e-3)]
    losses = []
    for _ in range(25):
        loss = _lm_loss(model, tokens)
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        assert values[0].grad.is_sparse
        # Two layers read at most 2 * tokens * heads * knn rows: never the dense table.
        assert values[0].grad._nnz() <= 2 * 4 * 32 * 2 * 4
        for opt in opts:
            opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_sparse_and_dense_model_gradients_agree():
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(3))
    grads = []
    for sparse in ("false", "true"):
        model = _build(_cfg("memplus", "[1]", f"memory.sparse_updates={sparse}"), seed=0)
        _lm_loss(model, tokens).backward()
        grads.append(value_parameters(model)[0].grad)
    assert not grads[0].is_sparse and grads[1].is_sparse
    assert torch.equal(grads[1].to_dense(), grads[0])


def test_aux_loss_channel():
    tokens = torch.randint(0, 512, (2, 9))
    model = _build(_cfg("memplus", "[0,1]", "memory.balance_loss_coef=0.5"))
    model(tokens)
    aux = model.aux_loss()
    assert aux is not None and aux.item() > 0
    aux.backward()
    assert model.layers[0].feed_forward.memory.lookup.keys.grad.abs().sum() > 0
    model.eval()
    model(tokens)
    assert model.aux_loss() is None  # no auxiliary loss outside training
    off = _build(_cfg("memplus", "[0,1]"))
    off(tokens)
    assert off.aux_loss() is None  # off by default


def test_knn_schedule_and_eval_knn_reach_every_layer():
    cfg = _cfg("memplus", "[0,1]", "memory.knn=8", "memory.eval_knn=3",
               "memory.knn_schedule_start=2", "memory.knn_schedule_steps=6")
    model = _build(cfg)
    lookups = [b.feed_forward.memory.lookup for b in model.layers]
    assert apply_knn_schedule(model, cfg.memory, 0) == 2
    assert [lk.knn for lk in lookups] == [2, 2]
    assert apply_knn_schedule(model, cfg.memory, 3) == 5
    assert apply_knn_schedule(model, cfg.memory, 100) == 8
    assert [lk.knn for lk in lookups] == [8, 8]
    tokens = torch.randint(0, 512, (1, 5))
    model.eval()
    model(tokens)
    model.train()
    model(tokens)
    # Only the training forward was counted, with knn=8 reads per head.
    assert usage_metrics(model)["memory/layer0/reads"] == 5 * 2 * 8
    assert apply_knn_schedule(model, _cfg("memplus", "[0,1]").memory, 5) is None


def test_parallel_placement_adds_dense_ffn():
    cfg = _cfg("memplus", "[1]", "memory.placement=parallel")
    model = _build(cfg)
    ffn = model.layers[1].feed_forward
    assert ffn.dense is not None
    x = torch.randn(2, 3, cfg.model.dim)
    torch.testing.assert_close(ffn(x), ffn.memory(x) + ffn.dense(x))
    assert ffn.flops_per_token() == ffn.memory.flops_per_token() + ffn.dense.flops_per_token()


def test_build_model_and_kv_cache_decode_match_full_forward():
    cfg = _cfg("memplus", "[0]")
    model = build_model(cfg.model, cfg.memory, seed=0).eval()
    tokens = torch.randint(0, 512, (1, 6))
    full = model(tokens)
    cache = model.new_cache(1, 16)
    steps = [model(tokens[:, i:i + 1], cache) for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
