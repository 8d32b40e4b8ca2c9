"""memory.fast.ops.embedding_bag against F.embedding_bag; sparse vs dense table gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.errors import ConfigError
from memlm.memory.fast.ops import embedding_bag, resolve_kernel, row_gradients


def _inputs(n=50, v=7, bags=9, reads=6, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, v, generator=gen, dtype=dtype, requires_grad=True)
    # Few slots, many reads: plenty of duplicates within and across bags.
    indices = torch.randint(0, n // 3, (bags, reads), generator=gen)
    weights = torch.rand(bags, reads, generator=gen, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(bags, v, generator=gen, dtype=dtype)
    return values, indices, weights, grad_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sparse", [False, True])
def test_equals_torch_embedding_bag(dtype, sparse):
    values, indices, weights, grad_out = _inputs(dtype=dtype)
    out = embedding_bag(values, indices, weights, sparse=sparse)
    ref = F.embedding_bag(indices, values, per_sample_weights=weights, mode="sum")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)
    g_values, g_weights = torch.autograd.grad(out, (values, weights), grad_out)
    r_values, r_weights = torch.autograd.grad(ref, (values, weights), grad_out)
    assert g_values.is_sparse == sparse
    torch.testing.assert_close(g_values.to_dense(), r_values, **tol)
    torch.testing.assert_close(g_weights, r_weights, **tol)


def test_sparse_gradient_holds_only_rows_read_and_equals_dense_exactly():
    values, indices, weights, grad_out = _inputs(n=1000, v=16, bags=64, reads=12)
    (dense,) = torch.autograd.grad(embedding_bag(values, indices, weights), values, grad_out)
    (sparse,) = torch.autograd.grad(embedding_bag(values, indices, weights, sparse=True), values, grad_out)
    assert sparse.is_sparse and sparse.is_coalesced()
    read = torch.unique(indices)
    assert torch.equal(sparse.indices()[0], read)  # one row per distinct slot read, no more
    assert sparse.values().shape == (read.numel(), 16)
    # Summed into a dense tensor: bit-for-bit the dense path's gradient.
    assert torch.equal(sparse.to_dense(), dense)
    assert torch.count_nonzero(dense.abs().sum(1)) == read.numel()


def test_sparse_gradients_of_several_reads_accumulate_like_dense():
    """A table read by three layers: accumulated sparse grads == dense grads."""
    values, indices, weights, grad_out = _inputs(n=200, v=8, bags=16, reads=5)
    table_dense = values.detach().clone().requires_grad_()
    table_sparse = values.detach().clone().requires_grad_()
    for shift in range(3):
        idx = (indices + 7 * shift) % 200
        embedding_bag(table_dense, idx, weights.detach()).backward(grad_out)
        embedding_bag(table_sparse, idx, weights.detach(), sparse=True).backward(grad_out)
    assert table_sparse.grad.is_sparse
    torch.testing.assert_close(table_sparse.grad.to_dense(), table_dense.grad, rtol=1e-6, atol=1e-6)


def test_row_gradients_by_destination_slot():
    indices = torch.tensor([[3, 1], [1, 1]])
    weights = torch.tensor([[0.5, 2.0], [1.0, 3.0]])
    grad_out = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])
    slots, rows = row_gradients(indices, weights, grad_out)
    assert slots.tolist() == [1, 3]
    expected_1 = 2.0 * grad_out[0] + (1.0 + 3.0) * grad_out[1]
    torch.testing.assert_close(rows, torch.stack([expected_1, 0.5 * grad_out[0]]))


def test_inference_and_frozen_table_paths():
    values, indices, weights, _ = _inputs()
    with torch.no_grad():
        out = embedding_bag(values, indices, weights)
    ref = F.embedding_bag(indices, values.detach(), per_sample_weights=weights.detach(), mode="sum")
    torch.testing.assert_close(out, ref)
    frozen = values.detach()
    out = embedding_bag(frozen, indices, weights)
    assert out.requires_grad  # the weights still get their gradient


def test_shapes_and_kernels_are_checked():
    values, indices, weights, _ = _inputs()
    with pytest.raises(ValueError, match="bags, reads"):
        embedding_bag(values, indices.flatten(), weights.flatten())
    assert resolve_kernel("auto", "cpu") == "torch"
    assert resolve_kernel("torch") == "torch"
    with pytest.raises(ConfigError, match="memory.kernel") as err:
        resolve_kernel("cuda")
    assert err.value.key == "memory.kernel"


def test_unavailable_kernel_fails_with_config_error():
    from memlm.memory.fast.ops import available_kernels

    assert "torch" in available_kernels()
    if "triton" not in available_kernels():
        with pytest.raises(ConfigError, match="memory.kernel"):
            resolve_kernel("triton")
    else:
        assert resolve_kernel("triton") == "triton"
