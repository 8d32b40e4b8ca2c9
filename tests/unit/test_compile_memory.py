"""torch.compile of memory blocks: no graph break, no recompile per knn, the custom ops, and the chunked loss.

Graph breaks and recompiles are what dynamo counts; the "aot_eager" backend
counts them as inductor would (it traces the same graphs, forward and
backward) without inductor's C++ compile time. One inductor test is marked slow.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from memlm.config.run import compose
from memlm.data.config import IGNORE

# Importing memlm.memory registers the memlm:: ops (memory/fast/ops.py, memory/fast/search_grad.py).
from memlm.memory import MemoryPlus, apply_knn_schedule, knn_at_step
from memlm.memory.fast import ops
from memlm.model import Transformer
from memlm.train.loss import chunk_tokens, chunked_cross_entropy

SMALL = ["memory.n_keys=16", "memory.k_dim=16", "memory.heads=2", "memory.knn=4", "memory.eval_knn=4",
         "memory.spread=0", "model.n_layers=2", "memory.layers=[1]", "model.vocab_size=64"]


def _model(*extra):
    cfg = compose(["memory=memplus", *SMALL, *extra])
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return cfg, model


def _step(model, tokens):
    """Loss, and the gradients of every parameter, of one forward+backward."""
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compile_memory_block(model):
    block = model.layers[1]
    assert block.ffn_kind == "memplus"
    counter = CompileCounterWithBackend("aot_eager")
    block.compile(backend=counter, fullgraph=True)  # fullgraph: a graph break would raise
    return counter


def _assert_same_step(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_memory_plus_block_has_no_graph_break_and_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    _, model = _model()
    eager = copy.deepcopy(model)
    counter = _compile_memory_block(model)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    _assert_same_step(_step(model, tokens), _step(eager, tokens))
    assert counter.frame_count == 1  # the whole block, search and read included, in one graph
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # The usage count (a buffer updated inside the graph) is the eager one.
    assert torch.equal(model.layers[1].feed_forward.memory.usage.counts,
                       eager.layers[1].feed_forward.memory.usage.counts)
    assert model.layers[1].feed_forward.memory.usage.counts.sum() == 2 * 8 * 2 * 4  # tokens * heads * knn


@pytest.mark.parametrize("kind", ["memplus", "moe"])
def test_blocks_compile_whole_where_dynamo_cannot_trace_the_autocast_check(monkeypatch, kind):
    """torch 2.11's dynamo cannot trace torch.amp.is_autocast_available (a C
    builtin): on an H200 (bench/device_check.sh) each call broke the Memory+
    block's graph, 10 breaks and 30 graphs. Make it untraceable here too:
    the blocks must still compile in one graph, under autocast and without."""
    monkeypatch.setattr(torch.amp, "is_autocast_available", torch._dynamo.disable(torch.amp.is_autocast_available))
    torch._dynamo.reset()
    _, model = _model(f"memory={kind}")
    block = model.layers[1]
    counter = CompileCounterWithBackend("aot_eager")
    block.compile(backend=counter, fullgraph=True)  # fullgraph: a graph break would raise
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(tokens).float().sum().backward()
    assert counter.frame_count == 2  # one graph per autocast state


def test_knn_schedule_over_8_values_recompiles_at_most_once():
    torch._dynamo.reset()
    cfg, model = _model("memory.knn=8", "memory.knn_schedule_start=1", "memory.knn_schedule_steps=7")
    eager = copy.deepcopy(model)
    counter = _compile_memory_block(model)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    seen = []
    for step in range(8):
        knn = apply_knn_schedule(model, cfg.memory, step)
        assert apply_knn_schedule(eager, cfg.memory, step) == knn == knn_at_step(step, 8, 1, 7)
        seen.append(knn)
        _assert_same_step(_step(model, tokens), _step(eager, tokens))
    assert seen == [1, 2, 3, 4, 5, 6, 7, 8]
    assert type(model.layers[1].feed_forward.memory.knn) is int  # readers see a plain int
    # knn is traced as a symbol: one graph for every value (the compiler
    # specializes the value 1, hence at most one recompile, when 2 comes).
    assert counter.frame_count <= 2


def test_compiled_layer_with_the_balance_loss_is_one_graph_like_eager():
    """The balance loss needs the sub-key scores' gradient: the search runs
    as memlm::product_key_ranks and the winners' scores are gathered (traced)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MemoryPlus(dim=16, n_keys=16, heads=2, knn=4, k_dim=8, balance_loss_coef=0.3)
    eager = copy.deepcopy(layer)
    x = torch.randn(2, 5, 16)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    results = []
    for module, run in ((eager, eager), (layer, compiled)):
        out = run(x)
        loss = out.square().sum() + module.last_aux_loss
        results.append((loss, torch.autograd.grad(loss, list(module.parameters()))))
    assert counter.frame_count == 1
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-6)
    for c, e in zip(grads_c, grads_e):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def _bag_inputs():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(20, 6, generator=gen, requires_grad=True)
    indices = torch.randint(0, 20, (4, 3), generator=gen)
    weights = torch.rand(4, 3, generator=gen, requires_grad=True)
    return values, indices, weights


def _search_inputs(shared_keys=False):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(5, 2, 2, 4, generator=gen, requires_grad=True)
    keys = torch.randn(*(() if shared_keys else (2,)), 2, 16, 4, generator=gen, requires_grad=True)
    return query, keys


def _opcheck_cases():
    values, indices, weights = _bag_inputs()
    yield "embedding_bag", torch.ops.memlm.embedding_bag.default, (values, indices, weights, False, "torch", [], [])
    grad_out = torch.randn(4, 6)
    for need in [(True, True), (False, True), (True, False)]:
        yield (f"embedding_bag_backward{need}", torch.ops.memlm.embedding_bag_backward.default,
               (grad_out, values.detach(), indices, weights.detach(), "torch", *need, []))
    for need_weights in (True, False):  # the read into a gradient buffer (memlm.memory.table_grads)
        yield (f"embedding_bag_accumulate_(need_weights={need_weights})",
               torch.ops.memlm.embedding_bag_accumulate_.default,
               (grad_out, values.detach(), torch.zeros_like(values.detach()), indices, weights.detach(), "torch",
                need_weights, []))
    for shared in (False, True):
        query, keys = _search_inputs(shared)
        for keep_sub in (False, True):
            yield (f"product_key_search(shared={shared}, keep_sub={keep_sub})",
                   torch.ops.memlm.product_key_search.default, (query, keys, 4, keep_sub, True))
        q, kk = query.detach(), keys.detach()
        sub = torch.einsum("thcd,cnd->thcn" if shared else "thcd,hcnd->thcn", q, kk)
        yield f"product_key_ranks(shared={shared})", torch.ops.memlm.product_key_ranks.default, (sub, 4, False)
        # n_keys 16 >= SPARSE_BACKWARD_RATIO (8) * knn 2: the sparse backward; knn 4: the dense one.
        for knn, kind in ((2, "sparse"), (4, "dense")):
            _, _, half_idx, ranks, _ = torch.ops.memlm.product_key_search(q, kk, knn, False, True)
            yield (f"product_key_search_backward({kind}, shared={shared})",
                   torch.ops.memlm.product_key_search_backward.default,
                   (torch.randn(5, 2, knn), q, kk, half_idx, ranks, True, True))


@pytest.mark.parametrize("name,op,args", list(_opcheck_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_custom_ops_pass_opcheck(name, op, args):
    # Schema, fake kernel (shapes, dtypes, strides) against the real one,
    # autograd registration, and tracing through AOT autograd (static and dynamic shapes).
    torch.library.opcheck(op, args)


def test_custom_ops_keep_the_eager_numbers_bit_for_bit():
    """The op route of the read gives exactly the old autograd.Function's
    numbers: F.embedding_bag forward, by-slot backward (memory/fast/bag_grad.py)."""
    from memlm.memory.fast.bag_grad import dense_gradient, sort_reads, weight_gradients

    values, indices, weights = _bag_inputs()
    out = ops.embedding_bag(values, indices, weights, kernel="torch")
    assert torch.equal(out, F.embedding_bag(indices, values, per_sample_weights=weights, mode="sum"))
    g = torch.randn_like(out)
    gv, gw = torch.autograd.grad(out, [values, weights], g)
    reads = sort_reads(indices, values.shape[0])
    assert torch.equal(gv, dense_gradient(indices, weights.detach(), g, values.shape[0], reads))
    assert torch.equal(gw, weight_gradients(values.detach(), indices, g, reads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_the_fp32_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 13, 50, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 13), generator=gen)
    chunk_bytes = 4 * 50 * 8  # 8 tokens per chunk: 39 tokens -> 5 chunks, the last one ragged
    assert chunk_tokens(50, chunk_bytes) == 8
    loss = chunked_cross_entropy(logits, targets, chunk_bytes)
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    g = torch.tensor(0.7)
    (grad,) = torch.autograd.grad(loss, logits, g)
    (ref_grad,) = torch.autograd.grad(ref, logits, g)
    assert grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    else:  # both are fp32 gradients rounded once to bf16
        torch.testing.assert_close(grad, ref_grad, rtol=1e-2, atol=1e-5)


def test_ignored_targets_add_nothing_to_the_chunked_cross_entropy():
    """data.rows=documents pads each row and marks the padding's targets IGNORE: the loss is the mean
    over the other tokens, and the ignored rows get a zero gradient."""
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 11, 40, generator=gen)).requires_grad_()
    targets = torch.randint(0, 40, (2, 11), generator=gen)
    targets[0, 7:] = IGNORE
    targets[1, 3:] = IGNORE
    loss = chunked_cross_entropy(logits, targets, 4 * 40 * 4)  # 4 tokens a chunk
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert torch.all(grad[0, 7:] == 0) and torch.all(grad[1, 3:] == 0)


def test_chunked_cross_entropy_keeps_no_fp32_copy_of_all_logits():
    """What autograd keeps for the backward: the reference keeps an fp32
    (tokens, vocab) tensor beside the bf16 logits; the chunked loss keeps
    only the bf16 logits and the targets (it recomputes each chunk's softmax)."""
    logits = torch.randn(64, 100).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 100, (64,))

    def saved_fp32_elements(fn):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return max((t.numel() for t in saved if t.dtype == torch.float32), default=0)

    assert saved_fp32_elements(lambda: F.cross_entropy(logits.float(), targets)) == 64 * 100
    assert saved_fp32_elements(lambda: chunked_cross_entropy(logits, targets, chunk_bytes=4 * 100 * 16)) == 0


def test_chunked_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \(2, 5, 7\) and targets \(2, 4\)"):
        chunked_cross_entropy(torch.randn(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.slow
def test_inductor_compiles_a_memory_plus_layer_in_one_graph_like_eager():
    """The real backend (inductor's C++ code) around the custom ops."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MemoryPlus(dim=16, n_keys=16, heads=2, knn=2, k_dim=8)
    x = torch.randn(2, 5, 16, requires_grad=True)
    ref = layer(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
