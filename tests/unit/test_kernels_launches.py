"""Every launch the device sweep can pick (bench/launch_sweep.py: BLOCK_B/BLOCK_S,
BLOCK_K, warps, maxnreg, the backward's busiest-first order) gives the
float32 reference's numbers exactly, and the default backward gives the same
bits in two runs. Issue #49's CPU must-show.

Exact: values, weights and output gradients are small multiples of powers of
two, so every product and partial sum is representable and any summation
order gives the reference's bits (== / torch.equal, no tolerance).

Like tests/unit/test_kernels_variants.py: compiled kernels on CUDA, or
Triton's interpreter on CPU when the process starts with TRITON_INTERPRET=1
(tests/unit/test_kernels_interpreter.py runs this file that way).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 set before start (tests/unit/test_kernels_interpreter.py "
                "runs this file that way on CPU)", allow_module_level=True)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from memlm.memory.fast import triton_bag  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
ROOT = Path(__file__).resolve().parents[2]


def _sweep():
    """bench/launch_sweep.py: the device run's candidates (one definition)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))  # it imports bench/kernels.py
    spec = importlib.util.spec_from_file_location("bench_launch_sweep", ROOT / "bench" / "launch_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SWEEP = _sweep()


def _exact_case(dtype, slots=24, v_dim=64, bags=9, reads=6, read=10, seed=0):
    """Entries that sum exactly: values in {-2..2}, weights in quarters, grad_out in {-2..2};
    slot 0 in every other read (a long segment), slots >= `read` never read."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-2, 3, (slots, v_dim), generator=gen).to(dtype)
    indices = torch.randint(0, read, (bags, reads), generator=gen)
    indices[:, ::2] = 0
    weights = torch.randint(0, 5, (bags, reads), generator=gen).float() / 4
    grad_out = torch.randint(-2, 3, (bags, v_dim), generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (values, indices, weights, grad_out)]


def _reference(values, indices, weights, grad_out):
    v = values.float().requires_grad_()
    w = weights.float().requires_grad_()
    out = F.embedding_bag(indices, v, per_sample_weights=w, mode="sum")
    gv, gw = torch.autograd.grad(out, (v, w), grad_out.float())
    return out.detach(), gv, gw


def _launches(sweep, rule):
    return [la._replace(block_d=rule.block_d) for la in SWEEP.candidates(rule, sweep)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_forward_launch_equals_the_reference(dtype):
    values, indices, weights, grad_out = _exact_case(dtype)
    want = _reference(values, indices, weights, grad_out)[0]
    rule = triton_bag.forward_launch(values.shape[1], indices.shape[1], indices.shape[0], dtype)
    launches = _launches(SWEEP.FORWARD_SWEEP, rule)
    assert any(la.maxnreg for la in launches) and len(launches) > 5
    for launch in launches:
        out = triton_bag.bag_forward(values, indices, weights, launch=launch)
        assert out.dtype == dtype and torch.equal(out.float(), want), launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_backward_launch_equals_the_reference(dtype):
    values, indices, weights, grad_out = _exact_case(dtype)
    _, ref_gv, ref_gw = _reference(values, indices, weights, grad_out)
    launches = _launches(SWEEP.SEGMENTS_SWEEP, triton_bag.segments_launch(values.shape[1], dtype))
    assert {la.num_warps for la in launches} >= {1, 4} and any(la.maxnreg for la in launches)
    assert {la.busiest_first for la in launches} == {False, True}
    for sparse in (False, True):
        order, seg_start, slots = triton_bag.group_by_slot(indices, values.shape[0], dense=not sparse)
        want = ref_gv if slots is None else ref_gv[slots]
        for launch in launches:
            rows, gw = triton_bag.segment_gradients(values, grad_out, order, seg_start, slots, weights, True, launch)
            assert torch.equal(rows.float(), want) and torch.equal(gw, ref_gw), (sparse, launch)


def test_every_backward_launch_accumulates_the_reference_into_a_buffer():
    values, indices, weights, grad_out = _exact_case(torch.float32)
    _, ref_gv, ref_gw = _reference(values, indices, weights, grad_out)
    held = torch.randint(-2, 3, values.shape).float().to(DEVICE)  # what earlier reads left in the buffer
    for launch in _launches(SWEEP.SEGMENTS_SWEEP, triton_bag.segments_launch(values.shape[1], values.dtype)):
        buffer = held.clone()
        gw = triton_bag.accumulate_gradients(values, buffer, indices, weights, grad_out, launch=launch)
        assert torch.equal(buffer, held + ref_gv) and torch.equal(gw, ref_gw), launch


def test_default_backward_gives_the_same_bits_twice():
    """Random (inexact) entries and a hot slot: the default launch's table and
    weights' gradients, dense, sparse and accumulated, bit for bit in two runs;
    the busiest-first order changes which program sums a segment, not how."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(40, 48, generator=gen).to(DEVICE)
    indices = torch.randint(0, 12, (10, 8), generator=gen)
    indices[:, 1::2] = 3  # slot 3 takes half the reads
    indices = indices.to(DEVICE)
    weights = torch.rand(10, 8, generator=gen).to(DEVICE)
    grad_out = torch.randn(10, 48, generator=gen).to(DEVICE)
    runs = []
    for _ in range(2):
        dense = triton_bag.gradients(values, indices, weights, grad_out)
        sparse = triton_bag.gradients(values, indices, weights, grad_out, sparse=True)
        buffer = torch.zeros_like(values)
        gw = triton_bag.accumulate_gradients(values, buffer, indices, weights, grad_out)
        runs.append((dense[0], dense[1], sparse[0].values(), sparse[1], buffer, gw))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    busiest = triton_bag.segments_launch(values.shape[1], values.dtype)._replace(busiest_first=True)
    buffer = torch.zeros_like(values)
    gw = triton_bag.accumulate_gradients(values, buffer, indices, weights, grad_out, launch=busiest)
    assert torch.equal(buffer, runs[0][4]) and torch.equal(gw, runs[0][5])
