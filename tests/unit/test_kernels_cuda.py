"""GPU-only checks of the Triton read kernels at realistic sizes (compiled
kernels, no interpreter). bench/device_check.sh runs these on a lent GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (compiled Triton kernels; see bench/device_check.sh)")

import torch.nn.functional as F  # noqa: E402

from memlm.memory.fast import ops, triton_bag  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _atomic_read(values, indices, weights):
    """bench/bag_variants.py's atomic read (the first kernels, comparison only)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_bag_variants", BENCH / "bag_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.embedding_bag_atomic(values, indices, weights)


def _case(n, v, bags, reads, dtype, hot=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    values = torch.randn(n, v, device="cuda", generator=gen).to(dtype)
    indices = torch.randint(0, hot or n, (bags, reads), device="cuda", generator=gen)
    weights = torch.rand(bags, reads, device="cuda", generator=gen)
    grad_out = torch.randn(bags, v, device="cuda", generator=gen)
    return values, indices, weights, grad_out


def _grads(values, indices, weights, grad_out, **kw):
    v = values.detach().requires_grad_()
    w = weights.detach().requires_grad_()
    if kw.pop("reference", False):
        out = F.embedding_bag(indices, v.float(), per_sample_weights=w, mode="sum")
        return (out, *torch.autograd.grad(out, (v, w), grad_out))
    if kw.pop("atomic", False):
        out = _atomic_read(v, indices, w)
    else:
        out = ops.embedding_bag(v, indices, w, kernel="triton", **kw)
    return (out, *torch.autograd.grad(out, (v, w), grad_out.to(out.dtype)))


def _rel_err(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,v_dim", [(torch.bfloat16, 1024), (torch.float32, 96)])
def test_realistic_shape_matches_embedding_bag(dtype, v_dim):
    # 2048 tokens x 4 heads x 32 reads into 64K slots.
    case = _case(65536, v_dim, 2048, 128, dtype)
    ours = _grads(*case)
    ref = _grads(*case, reference=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(ours, ref):
        assert _rel_err(got, want) < tol


def test_hot_slots_deterministic_and_atomic_agrees():
    case = _case(4096, 256, 1024, 128, torch.float32, hot=64)  # ~2000 reads per slot
    first, second = _grads(*case), _grads(*case)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    atomic = _grads(*case, atomic=True)
    assert _rel_err(atomic[1], first[1]) < 1e-5
    sparse = _grads(*case, sparse=True)
    assert torch.equal(sparse[1].to_dense(), first[1])


def test_addresses_beyond_int32():
    # 2**21 + 16 slots x 1024 bf16 columns: slot * stride exceeds 2**31 elements.
    n = 2**21 + 16
    values = torch.zeros(n, 1024, device="cuda", dtype=torch.bfloat16)
    values[-1] = 1.0
    indices = torch.tensor([[n - 1, 0]], device="cuda", dtype=torch.int32)
    out = ops.embedding_bag(values, indices, torch.tensor([[2.0, 1.0]], device="cuda"), kernel="triton")
    assert torch.equal(out, torch.full_like(out, 2.0))


def test_auto_dispatches_to_triton_on_cuda(monkeypatch):
    calls = []
    real = triton_bag.bag_forward
    monkeypatch.setattr(triton_bag, "bag_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    values, indices, weights, _ = _case(100, 64, 4, 8, torch.float32)
    ops.embedding_bag(values, indices, weights)  # kernel="auto"
    assert calls


def test_bad_index_on_cuda_stops_with_device_assert():
    # Default CUDA check is asynchronous and poisons the context: run it in a child.
    code = textwrap.dedent("""
        import torch
        from memlm.memory.fast import ops
        v = torch.randn(10, 8, device="cuda")
        y = ops.embedding_bag(v, torch.tensor([[3, 10]], device="cuda"), torch.ones(1, 2, device="cuda"))
        torch.cuda.synchronize()
        print("NO ERROR")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode != 0 and "NO ERROR" not in proc.stdout, proc.stdout + proc.stderr
