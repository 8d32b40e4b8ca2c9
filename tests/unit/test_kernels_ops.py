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
