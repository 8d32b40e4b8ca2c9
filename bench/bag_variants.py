"""The memory read's first Triton kernels, kept for comparison only (bench/speed_kernels.py, bench/kernels.py).

    out = bag_forward_by_slot(values, indices, weights)                          # (B, V)
    grad_values, grad_weights = gradients_by_slot(values, indices, weights, grad_out)
    grad_values, grad_weights = gradients_atomic(values, indices, weights, grad_out)
    out = embedding_bag_by_slot(values, indices, weights)                        # differentiable
    out = embedding_bag_atomic(values, indices, weights)

The kernels memlm trained with before issue #39 ("by_slot", deterministic)
and their atomic variant ("atomic", not deterministic). memlm's read
(memory/fast/triton_bag.py) no longer runs them; the device run times them
beside it. Inputs as triton_bag's launchers: a table with unit column
stride, contiguous (B, K) indices and weights, indices in [0, N).

- by_slot forward: one program per (bag, 256 columns), 16 rows a step.
- by_slot table gradient: one program per (segment of the sorted reads,
  256 columns).
- atomic table gradient: w * grad_out[bag] added into a float32 copy of the
  table with atomics.
- weights' gradient of both: triton_bag.weight_grad by 256-column tiles,
  every read's value row read again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memlm.memory.fast.triton_bag import group_by_slot, weight_grad


@triton.jit
def _bag_forward_kernel(values, stride_v, indices, weights, out, K, V,
                        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        idx = tl.load(indices + bag * K + ks, mask=kmask, other=0).to(tl.int64)
        w = tl.load(weights + bag * K + ks, mask=kmask, other=0.0).to(tl.float32)
        rows = tl.load(values + idx[:, None] * stride_v + cols[None, :],
                       mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(rows.to(tl.float32) * w[:, None], axis=0)
    tl.store(out + bag * V + cols, acc.to(out.dtype.element_ty), mask=cmask)


@triton.jit
def _grad_by_slot_kernel(grad_out, order, seg_start, weights, grad_rows, stride_r, K, V,
                         BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # Program p owns segment [seg_start[p], seg_start[p+1]) of the sorted reads
    # and writes row p of grad_rows; order[j] is the flat (bag * K + k) read.
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    start = tl.load(seg_start + p)
    end = tl.load(seg_start + p + 1)
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for j0 in range(start, end, BLOCK_K):
        js = j0 + tl.arange(0, BLOCK_K)
        jmask = js < end
        read = tl.load(order + js, mask=jmask, other=0).to(tl.int64)
        w = tl.load(weights + read, mask=jmask, other=0.0).to(tl.float32)
        bag = read // K
        g = tl.load(grad_out + bag[:, None] * V + cols[None, :],
                    mask=jmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(g.to(tl.float32) * w[:, None], axis=0)
    tl.store(grad_rows + p * stride_r + cols, acc.to(grad_rows.dtype.element_ty), mask=cmask)


@triton.jit
def _grad_atomic_kernel(grad_out, indices, weights, grad_acc, K, V, BLOCK_V: tl.constexpr):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    g = tl.load(grad_out + bag * V + cols, mask=cmask, other=0.0).to(tl.float32)
    for k in range(0, K):
        idx = tl.load(indices + bag * K + k).to(tl.int64)
        w = tl.load(weights + bag * K + k).to(tl.float32)
        tl.atomic_add(grad_acc + idx * V + cols, g * w, mask=cmask)


def _blocks(reads: int, v_dim: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): a 16 x 256 tile, smaller for small problems."""
    return min(16, triton.next_power_of_2(max(reads, 1))), min(256, triton.next_power_of_2(max(v_dim, 1)))


def bag_forward_by_slot(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, V), (B, K), (B, K) -> (B, V) in the table's dtype, by tiles."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    out = torch.empty(bags, v_dim, dtype=values.dtype, device=values.device)
    if bags == 0 or v_dim == 0:
        return out
    if reads == 0:
        return out.zero_()
    bk, bv = _blocks(reads, v_dim)
    _bag_forward_kernel[(bags, triton.cdiv(v_dim, bv))](values, values.stride(0), indices, weights, out, reads,
                                                        v_dim, BLOCK_K=bk, BLOCK_V=bv)
    return out


def _weights_gradient(values, indices, grad_out, dtype) -> torch.Tensor:
    return weight_grad(values, indices, grad_out, dtype, *_blocks(indices.shape[1], values.shape[1]))


def gradients_by_slot(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                      grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense table gradient (N, V), weights' gradient (B, K)): one program per (slot, 256 columns)."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    order, seg_start, _ = group_by_slot(indices, values.shape[0])
    rows = torch.empty(values.shape, dtype=values.dtype, device=values.device)
    if values.shape[0] and v_dim:
        bk, bv = _blocks(reads, v_dim)
        _grad_by_slot_kernel[(values.shape[0], triton.cdiv(v_dim, bv))](
            grad_out, order, seg_start, weights, rows, rows.stride(0), reads, v_dim, BLOCK_K=bk, BLOCK_V=bv)
    return rows, _weights_gradient(values, indices, grad_out, weights.dtype)


def gradients_atomic(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                     grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense table gradient (N, V), weights' gradient (B, K)): float32 atomics, not deterministic."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    acc = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    if bags and reads and v_dim:
        _, bv = _blocks(reads, v_dim)
        _grad_atomic_kernel[(bags, triton.cdiv(v_dim, bv))](grad_out, indices, weights, acc, reads, v_dim,
                                                            BLOCK_V=bv)
    return acc.to(values.dtype), _weights_gradient(values, indices, grad_out, weights.dtype)


class _Read(torch.autograd.Function):
    """One of the first kernels' reads, differentiable (values and weights)."""

    @staticmethod
    def forward(ctx, values, indices, weights, backward):
        ctx.save_for_backward(values, indices, weights)
        ctx.backward = backward
        return bag_forward_by_slot(values, indices, weights)

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, weights = ctx.saved_tensors
        grad_values, grad_weights = ctx.backward(values, indices, weights, grad_out.contiguous())
        return grad_values, None, grad_weights, None


def embedding_bag_by_slot(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _Read.apply(values, indices, weights, gradients_by_slot)


def embedding_bag_atomic(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _Read.apply(values, indices, weights, gradients_atomic)
