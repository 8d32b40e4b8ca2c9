"""memory.fast.row_dots (PEER's down projection) against the plain gather + matmul it replaces."""

from __future__ import annotations

import pytest
import torch

from memlm.memory.fast.row_dots import row_dots


def _reference(table, indices, x):
    return torch.einsum("bkd,bd->bk", table[indices], x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_equal_the_gather_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 12, generator=gen, dtype=dtype, requires_grad=True)
    x = torch.randn(7, 12, generator=gen, dtype=dtype, requires_grad=True)
    indices = torch.randint(0, 50, (7, 9), generator=gen)
    indices[0, :3] = 4  # repeated rows, within and across bags
    indices[1, 0] = 4
    g = torch.randn(7, 9, generator=gen, dtype=dtype)
    out = row_dots(table, indices, x)
    got = torch.autograd.grad(out, [table, x], g)
    ref = _reference(table, indices, x)
    want = torch.autograd.grad(ref, [table, x], g)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-12}
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    assert got[0][torch.tensor([i for i in range(50) if i not in set(indices.flatten().tolist())])].abs().max() == 0


def test_gradcheck():
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(10, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    indices = torch.randint(0, 10, (3, 5), generator=gen)
    assert torch.autograd.gradcheck(lambda t, v: row_dots(t, indices, v), (table, x))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"x must be \(B, dim\) = \(2, 4\)"):
        row_dots(torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/device_check.sh runs it on one)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_cpu_path(dtype):
    """On CUDA the dot products take the public route (the read re-run under
    autograd); same values and gradients as on CPU, at a PEER-like shape."""
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(4096, 256, generator=gen)
    x = torch.randn(512, 256, generator=gen)
    indices = torch.randint(0, 4096, (512, 128), generator=gen)
    g = torch.randn(512, 128, generator=gen)
    results = []
    for device, dt in (("cpu", torch.float32), ("cuda", dtype)):
        t = table.to(device, dt).requires_grad_()
        v = x.to(device, dt).requires_grad_()
        out = row_dots(t, indices.to(device), v)
        grads = torch.autograd.grad(out, [t, v], g.to(device, out.dtype))
        results.append([r.float().cpu() for r in (out, *grads)])
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.3, "rtol": 0.05}
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, **tol)
