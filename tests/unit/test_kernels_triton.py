"""The Triton read kernels against F.embedding_bag.

Runs on CUDA with the compiled kernels when a GPU is present (what
bench/device_check.sh runs), or on CPU through Triton's interpreter when the
process was started with TRITON_INTERPRET=1. Plain CPU CI runs this file in
such a subprocess from tests/unit/test_kernels_interpreter.py, so the interpreter
setting never leaks into the other test modules of the same pytest process
(Triton fixes it when a kernel is defined, i.e. at import). Shapes are tiny:
the interpreter runs each program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before start (tests/unit/test_kernels_interpreter.py "
                "runs this file that way on CPU)", allow_module_level=True)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from memlm.memory.fast import ops  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def _inputs(n=40, v=96, bags=7, reads=6, dtype=torch.float32, index_dtype=torch.int64, hot=None, seed=0):
    """Few slots, many reads: duplicates within and across bags. Slots >= hot
    (default n // 2) are never read."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, v, generator=gen).to(dtype)
    indices = torch.randint(0, hot or n // 2, (bags, reads), generator=gen).to(index_dtype)
    weights = torch.rand(bags, reads, generator=gen)
    grad_out = torch.randn(bags, v, generator=gen)
    return [t.to(DEVICE) for t in (values, indices, weights, grad_out)]


def _reference(values, indices, weights, grad_out):
    """F.embedding_bag in float32 (exact copies of bf16 entries) -> out, table grad, weight grad."""
    v = values.detach().float().requires_grad_()
    w = weights.detach().float().requires_grad_()
    out = F.embedding_bag(indices.long(), v, per_sample_weights=w, mode="sum")
    gv, gw = torch.autograd.grad(out, (v, w), grad_out.float())
    return out, gv, gw


def _ours(values, indices, weights, grad_out, sparse=False):
    v = values.detach().requires_grad_()
    w = weights.detach().requires_grad_()
    out = ops.embedding_bag(v, indices, w, sparse=sparse, kernel="triton")
    gv, gw = torch.autograd.grad(out, (v, w), grad_out.to(out.dtype))
    return out, gv, gw


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    else:  # bf16/fp16 table: relative 1e-2 of the result's scale (bf16 keeps 8 bits)
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("dtype,index_dtype,v_dim", [
    (torch.float32, torch.int64, 96),   # non-power-of-two width: masked column blocks
    (torch.float32, torch.int32, 16),
    (torch.bfloat16, torch.int64, 96),
    (torch.bfloat16, torch.int32, 33),
    (torch.float16, torch.int64, 8),
])
def test_forward_and_gradients_equal_embedding_bag(dtype, index_dtype, v_dim):
    values, indices, weights, grad_out = _inputs(v=v_dim, dtype=dtype, index_dtype=index_dtype)
    out, gv, gw = _ours(values, indices, weights, grad_out)
    ref_out, ref_gv, ref_gw = _reference(values, indices, weights, grad_out)
    assert out.dtype == dtype and gv.dtype == dtype and gw.dtype == weights.dtype
    _close(out, ref_out, dtype)
    _close(gv, ref_gv, dtype)
    _close(gw, ref_gw, dtype)
    # Slots never read get exactly zero, not merely small.
    unread = torch.ones(values.shape[0], dtype=torch.bool, device=DEVICE)
    unread[indices.long().flatten()] = False
    assert unread.any() and torch.count_nonzero(gv[unread]) == 0


def test_repeated_indices_within_and_across_bags():
    values, _, _, grad_out = _inputs(n=10, v=24, bags=3, reads=4)
    indices = torch.tensor([[2, 2, 2, 5], [5, 2, 7, 7], [9, 9, 9, 9]], device=DEVICE)
    weights = torch.tensor([[0.5, 1.0, 2.0, 1.0], [3.0, 0.25, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    out, gv, gw = _ours(values, indices, weights, grad_out)
    ref_out, ref_gv, ref_gw = _reference(values, indices, weights, grad_out)
    _close(out, ref_out, torch.float32)
    _close(gv, ref_gv, torch.float32)
    _close(gw, ref_gw, torch.float32)
    torch.testing.assert_close(gv[2], 3.5 * grad_out[0] + 0.25 * grad_out[1])
    torch.testing.assert_close(gv[7], torch.zeros_like(gv[7]), atol=1e-6, rtol=0)  # +1 and -1 cancel
    for slot in (0, 1, 3, 4, 6, 8):
        assert torch.count_nonzero(gv[slot]) == 0


def test_single_bag():
    values, indices, weights, grad_out = _inputs(bags=1, reads=5, v=40)
    for got, want in zip(_ours(values, indices, weights, grad_out), _reference(values, indices, weights, grad_out)):
        _close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_gradient_is_coalesced_and_bitwise_equal_to_dense(dtype):
    values, indices, weights, grad_out = _inputs(dtype=dtype)
    _, dense, _ = _ours(values, indices, weights, grad_out)
    _, sparse, _ = _ours(values, indices, weights, grad_out, sparse=True)
    assert sparse.is_sparse and sparse.is_coalesced() and sparse.dtype == dtype
    assert torch.equal(sparse.indices()[0], torch.unique(indices.long()))
    assert torch.equal(sparse.to_dense(), dense)


def test_backward_is_deterministic():
    # Hot slots (12 slots, 64 reads) put many reads in each segment.
    values, indices, weights, grad_out = _inputs(n=30, v=48, bags=8, reads=8, hot=12)
    first = _ours(values, indices, weights, grad_out)
    second = _ours(values, indices, weights, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    s1 = _ours(values, indices, weights, grad_out, sparse=True)[1]
    s2 = _ours(values, indices, weights, grad_out, sparse=True)[1]
    assert torch.equal(s1.values(), s2.values())


def test_frozen_table_and_no_grad():
    values, indices, weights, grad_out = _inputs()
    w = weights.clone().requires_grad_()
    out = ops.embedding_bag(values, indices, w, kernel="triton")  # table without grad
    (gw,) = torch.autograd.grad(out, w, grad_out)
    _, _, ref_gw = _reference(values, indices, weights, grad_out)
    _close(gw, ref_gw, torch.float32)
    with torch.no_grad():
        out = ops.embedding_bag(values.requires_grad_(), indices, weights, kernel="triton")
    assert not out.requires_grad
    _close(out, _reference(values, indices, weights, grad_out)[0], torch.float32)


def test_non_contiguous_indices_and_row_strided_table_are_read_correctly():
    values, indices, weights, grad_out = _inputs(v=32)
    wide = torch.randn(values.shape[0], 64, device=DEVICE)
    wide[:, 8:40] = values
    strided = wide[:, 8:40]  # row stride 64, unit column stride: read in place
    idx_t = indices.t().contiguous().t()  # same values, transposed memory
    w_t = weights.t().contiguous().t()
    assert not idx_t.is_contiguous() and not strided.is_contiguous()
    out = ops.embedding_bag(strided, idx_t, w_t, kernel="triton")
    _close(out, _reference(values, indices, weights, grad_out)[0], torch.float32)


def test_bad_inputs_fail_clearly(monkeypatch):
    # On CUDA the synchronous bounds check is the debug mode (see ops._check_indices).
    monkeypatch.setenv(ops.CHECK_INDICES_ENV, "1")
    values, indices, weights, _ = _inputs()
    n = values.shape[0]
    bag = ops.embedding_bag
    with pytest.raises(IndexError, match=rf"\[{n}, {n}\].*{n} slots"):
        bag(values, torch.full_like(indices, n), weights, kernel="triton")
    with pytest.raises(IndexError, match=r"\[-1, "):
        bag(values, indices - 1 - indices.min(), weights, kernel="triton")
    with pytest.raises(ValueError, match="bags, reads"):
        bag(values, indices, weights[:, :-1], kernel="triton")
    with pytest.raises(ValueError, match="bags, reads"):
        bag(values, indices.flatten(), weights.flatten(), kernel="triton")
    with pytest.raises(ValueError, match=r"\(slots, v_dim\)"):
        bag(values[None], indices, weights, kernel="triton")
    with pytest.raises(ValueError, match="int32 or int64"):
        bag(values, indices.float(), weights, kernel="triton")
    with pytest.raises(ValueError, match="floating point"):
        bag(values.long(), indices, weights, kernel="triton")
    with pytest.raises(ValueError, match="contiguous along v_dim"):
        bag(values.t().contiguous().t(), indices, weights, kernel="triton")
    with pytest.raises(ValueError, match="memory.kernel=torch"):
        bag(values.double(), indices, weights, kernel="triton")


def test_memory_layer_with_triton_kernel_matches_torch_kernel():
    from memlm.memory import MemoryPlus

    torch.manual_seed(0)
    layers = [MemoryPlus(16, n_keys=8, heads=2, knn=4, k_dim=8, kernel=k).to(DEVICE) for k in ("torch", "triton")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 5, 16, device=DEVICE)
    outs = [layer(x) for layer in layers]
    _close(outs[1], outs[0].detach(), torch.float32)
    grads = [torch.autograd.grad(o.square().sum(), layer.values.weight)[0] for o, layer in zip(outs, layers)]
    _close(grads[1], grads[0], torch.float32)
