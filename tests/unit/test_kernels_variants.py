"""Every Triton read (memory/fast/triton_bag.py's "segments"; the first
kernels "by_slot" and "atomic", kept for comparison in bench/bag_variants.py)
against a float32 F.embedding_bag, pass by pass: forward, table gradient
dense and sparse, weights' gradient. Issue #39's CPU must-show.

Like tests/unit/test_kernels_triton.py: compiled kernels on CUDA, or Triton's
interpreter on CPU when the process starts with TRITON_INTERPRET=1
(tests/unit/test_kernels_interpreter.py runs this file that way). Tiny shapes.
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

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from memlm.memory.fast import triton_bag  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bag_variants():
    """bench/bag_variants.py (the first kernels)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_bag_variants", BENCH / "bag_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIRST = _bag_variants()
# name -> (forward, gradients (dense table gradient, weights' gradient)); "segments" also has a sparse gradient.
READS = {
    "segments": (triton_bag.bag_forward, triton_bag.gradients),
    "by_slot": (FIRST.bag_forward_by_slot, FIRST.gradients_by_slot),
    "atomic": (FIRST.bag_forward_by_slot, FIRST.gradients_atomic),
}

# name: (slots, v_dim, bags, reads, table dtype, index dtype, slots read)
CASES = {
    "v96-int64": (40, 96, 7, 6, torch.float32, torch.int64, 20),     # v_dim not a power of two
    "v33-int32-bf16": (40, 33, 5, 8, torch.bfloat16, torch.int32, 20),
    "v16-many-bags": (24, 16, 11, 3, torch.float32, torch.int64, 12),  # several bags per forward program
    "hot-slot": (30, 40, 6, 5, torch.float32, torch.int64, 15),        # slot 0 in every bag (see _case)
}


def _case(name, seed=0):
    """values (N, V), indices (B, K), weights (B, K), grad_out (B, V); slots >= `read` never read."""
    n, v, bags, reads, dtype, index_dtype, read = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, v, generator=gen).to(dtype)
    indices = torch.randint(0, read, (bags, reads), generator=gen).to(index_dtype)
    if name == "hot-slot":
        indices[:, ::2] = 0  # one slot read by every bag, three times each: its segment spans all bags
    weights = torch.rand(bags, reads, generator=gen)
    grad_out = torch.randn(bags, v, generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (values, indices, weights, grad_out)]


def _reference(values, indices, weights, grad_out):
    """float32 F.embedding_bag (exact copies of bf16 entries) -> out (B, V), table grad (N, V), weight grad (B, K)."""
    v = values.float().requires_grad_()
    w = weights.float().requires_grad_()
    out = F.embedding_bag(indices.long(), v, per_sample_weights=w, mode="sum")
    gv, gw = torch.autograd.grad(out, (v, w), grad_out.float())
    return out.detach(), gv, gw


def _close(got, want, dtype):
    """float32: accumulation-order noise; bf16 results are rounded to 8 bits."""
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def _unread_rows_are_zero(grad, indices):
    unread = torch.ones(grad.shape[0], dtype=torch.bool, device=grad.device)
    unread[indices.long().flatten()] = False
    assert unread.any() and torch.count_nonzero(grad[unread]) == 0


@pytest.mark.parametrize("algorithm", sorted(READS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_equals_reference(algorithm, name):
    values, indices, weights, grad_out = _case(name)
    out = READS[algorithm][0](values, indices, weights)
    assert out.dtype == values.dtype
    _close(out, _reference(values, indices, weights, grad_out)[0], values.dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_in_short_steps_equals_reference(name):
    # 2 reads a step (the next step's indices prefetched), 4 bags a program (the last one partly masked).
    values, indices, weights, grad_out = _case(name)
    launch = triton_bag.forward_launch(values.shape[1], indices.shape[1], indices.shape[0], values.dtype)
    out = triton_bag.bag_forward(values, indices, weights, launch=launch._replace(block_b=4, block_k=2))
    _close(out, _reference(values, indices, weights, grad_out)[0], values.dtype)


@pytest.mark.parametrize("algorithm", sorted(READS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_equal_reference(algorithm, name):
    values, indices, weights, grad_out = _case(name)
    _, ref_gv, ref_gw = _reference(values, indices, weights, grad_out)
    for sparse in ((False, True) if algorithm == "segments" else (False,)):
        gv, gw = READS[algorithm][1](values, indices, weights, grad_out, *((sparse,) if sparse else ()))
        assert gv.dtype == values.dtype and gw.dtype == weights.dtype
        if sparse:
            assert gv.is_sparse and gv.is_coalesced()
            assert torch.equal(gv.indices()[0], torch.unique(indices.long()))
            gv = gv.to_dense()
        _close(gv, ref_gv, values.dtype)
        _close(gw, ref_gw, torch.float32)
        _unread_rows_are_zero(gv, indices)


@pytest.mark.parametrize("need", [(True, False), (False, True)])
def test_one_gradient_alone(need):
    # A frozen table (weights' gradient only) or frozen weights: the other is None.
    values, indices, weights, grad_out = _case("v96-int64")
    _, ref_gv, ref_gw = _reference(values, indices, weights, grad_out)
    gv, gw = triton_bag.gradients(values, indices, weights, grad_out, False, *need)
    assert (gv is None) != need[0] and (gw is None) != need[1]
    if need[0]:
        _close(gv, ref_gv, torch.float32)
    else:
        _close(gw, ref_gw, torch.float32)


@pytest.mark.parametrize("sparse", [False, True])
def test_segments_over_several_column_blocks(sparse):
    # v_dim wider than one column block (as above MAX_BLOCK_D): the table
    # gradient is taken per block and the weights' gradient by its own kernel.
    values, indices, weights, grad_out = _case("v96-int64")
    launch = triton_bag.Launch(block_b=3, block_k=2, block_d=32, num_warps=1, num_stages=1)
    order, seg_start, slots = triton_bag.group_by_slot(indices, values.shape[0], dense=not sparse)
    rows, gw = triton_bag.segment_gradients(values, grad_out, order, seg_start, slots, weights, True, launch)
    assert gw is None  # not fused across column blocks
    _, ref_gv, _ = _reference(values, indices, weights, grad_out)
    want = ref_gv if slots is None else ref_gv[slots]
    _close(rows, want, torch.float32)
    out = triton_bag.bag_forward(values, indices, weights, launch=launch._replace(block_b=2))
    _close(out, _reference(values, indices, weights, grad_out)[0], torch.float32)


def test_default_backward_is_bitwise_reproducible():
    # Many reads per segment (12 slots, 64 reads), both gradients, dense and sparse.
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(30, 48, generator=gen).to(DEVICE)
    indices = torch.randint(0, 12, (8, 8), generator=gen).to(DEVICE)
    weights = torch.rand(8, 8, generator=gen).to(DEVICE)
    grad_out = torch.randn(8, 48, generator=gen).to(DEVICE)
    for sparse in (False, True):
        first = triton_bag.gradients(values, indices, weights, grad_out, sparse=sparse)
        second = triton_bag.gradients(values, indices, weights, grad_out, sparse=sparse)
        if sparse:
            assert torch.equal(first[0].indices(), second[0].indices())
            first, second = (first[0].values(), first[1]), (second[0].values(), second[1])
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_sparse_rows_are_the_dense_rows_bit_for_bit():
    values, indices, weights, grad_out = _case("v33-int32-bf16")
    dense, gw_dense = triton_bag.gradients(values, indices, weights, grad_out, sparse=False)
    sparse, gw_sparse = triton_bag.gradients(values, indices, weights, grad_out, sparse=True)
    assert torch.equal(sparse.to_dense(), dense) and torch.equal(gw_sparse, gw_dense)

