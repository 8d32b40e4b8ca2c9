"""Kernel dispatch rules and input checks of memory.fast.ops.embedding_bag (no GPU,
no Triton interpreter: these never launch a Triton kernel)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from memlm.errors import ConfigError
from memlm.memory.fast import ops

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _inputs(n=30, v=12, bags=5, reads=4):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(n, v, generator=gen, requires_grad=True)
    indices = torch.randint(0, n, (bags, reads), generator=gen)
    weights = torch.rand(bags, reads, generator=gen)
    return values, indices, weights


def test_auto_picks_torch_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv(ops.INTERPRET_ENV, "1")  # even with the interpreter on: it is for tests only
    assert ops.resolve_kernel("auto", "cpu") == "torch"
    assert ops.resolve_kernel("torch", "cpu") == "torch"


def test_auto_picks_triton_for_cuda_tensors_when_importable():
    assert ops.resolve_kernel("auto", "cuda") == ("triton" if HAS_TRITON else "torch")
    assert ("triton" in ops.available_kernels("cuda")) == HAS_TRITON


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv(ops.INTERPRET_ENV, raising=False)
    assert ops.available_kernels("cpu") == ["torch"]
    with pytest.raises(ConfigError, match="memory.kernel") as err:
        ops.resolve_kernel("triton", "cpu")
    assert err.value.key == "memory.kernel"
    if HAS_TRITON:
        assert "TRITON_INTERPRET" in str(err.value)
    values, indices, weights = _inputs()
    with pytest.raises(ConfigError, match="memory.kernel"):
        ops.embedding_bag(values, indices, weights, kernel="triton")
    if HAS_TRITON:
        monkeypatch.setenv(ops.INTERPRET_ENV, "1")
        assert ops.resolve_kernel("triton", "cpu") == "triton"
        assert ops.available_kernels("cpu") == ["torch", "triton"]


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_torch_path_rejects_bad_inputs(kernel):
    values, indices, weights = _inputs()
    bag = ops.embedding_bag
    with pytest.raises(IndexError, match="out of range.*30 slots"):
        bag(values, indices + 30, weights, kernel=kernel)
    with pytest.raises(IndexError, match=r"\[-3, "):
        bag(values, indices - 3 - indices.min(), weights, kernel=kernel)
    with pytest.raises(ValueError, match="bags, reads"):
        bag(values, indices, weights[:-1], kernel=kernel)
    with pytest.raises(ValueError, match=r"\(slots, v_dim\)"):
        bag(values.flatten(), indices, weights, kernel=kernel)
    with pytest.raises(ValueError, match="int32 or int64"):
        bag(values, indices.to(torch.int16), weights, kernel=kernel)
    with pytest.raises(ValueError, match="floating point"):
        bag(values, indices, (weights > 0.5), kernel=kernel)


@pytest.mark.parametrize("sparse", [False, True])
def test_torch_path_takes_int32_indices(sparse):
    values, indices, weights = _inputs()
    out = ops.embedding_bag(values, indices.int(), weights, sparse=sparse)
    (grad,) = torch.autograd.grad(out.sum(), values)
    ref = F.embedding_bag(indices, values, per_sample_weights=weights, mode="sum")
    (ref_grad,) = torch.autograd.grad(ref.sum(), values)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad.to_dense(), ref_grad)


def test_torch_path_reads_a_non_contiguous_table():
    values, indices, weights = _inputs()
    table = values.detach().t().contiguous().t()
    torch.testing.assert_close(ops.embedding_bag(table, indices, weights),
                               F.embedding_bag(indices, values.detach(), per_sample_weights=weights, mode="sum"))


def _no_fused_dots(*args, **kwargs):
    raise RuntimeError("not on this device")  # what CUDA's bfloat16 per-sample-weights backward says


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
def test_weights_gradient_off_the_cpu_route_inside_the_ops_backward(monkeypatch, dtype, sparse):
    """Off CPU the read's weights gradient is gathered dot products: it runs
    inside the custom op's backward, where autograd is off below the
    dispatcher (on an H200 the old autograd route raised "element 0 of
    tensors does not require grad"). With the CPU's fused aten op made to
    fail, the same route runs here; its numbers are the float64 ones."""
    values, indices, weights = _inputs(n=40, v=16, bags=9, reads=6)
    values = values.detach().to(dtype).requires_grad_()
    weights.requires_grad_()
    g = torch.randn(9, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    monkeypatch.setattr(torch.ops.aten, "_embedding_bag_per_sample_weights_backward", _no_fused_dots)
    out = ops.embedding_bag(values, indices, weights, sparse=sparse, kernel="torch")
    gv, gw = torch.autograd.grad(out, [values, weights], g)
    expected = (values.detach().double()[indices] * g.double()[:, None, :]).sum(-1)
    assert gw.dtype == weights.dtype
    torch.testing.assert_close(gw.double(), expected, rtol=1e-6, atol=1e-6)
    assert gv.shape == values.shape


def test_gathered_dots_in_chunks_equal_one_gather(monkeypatch):
    from memlm.memory.fast import bag_grad

    values, indices, _ = _inputs(n=50, v=8, bags=13, reads=5)
    grad_out = torch.randn(13, 8, generator=torch.Generator().manual_seed(2))
    whole = bag_grad.gathered_dots(values, indices, grad_out)
    monkeypatch.setattr(bag_grad, "GATHER_ELEMENTS", 2 * 5 * 8)  # two tokens a chunk, the last one alone
    assert torch.equal(bag_grad.gathered_dots(values, indices, grad_out), whole)
    torch.testing.assert_close(whole, (values.detach()[indices] * grad_out[:, None, :]).sum(-1))
