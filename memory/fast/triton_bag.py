"""Triton kernels for the memory read (docs/memory.md, "Kernels").

    y[b] = sum_k weights[b, k] * values[indices[b, k]]          values (N, V), indices/weights (B, K)

Reached through `memlm.memory.fast.ops.embedding_bag(..., kernel="triton")` (or
`auto` on CUDA), which validates the inputs first; the launchers here assume
valid inputs: a table with unit column stride, contiguous (B, K) indices
(int32 or int64) and weights, indices in [0, N).

Kernels (all accumulate in float32 whatever the table dtype):
- forward: one program per (bag, block of columns); it gathers a
  (BLOCK_K, BLOCK_V) tile of rows per step, so BLOCK_K row loads are in flight
  at once (the read is bandwidth bound: latency hiding is what matters).
- table gradient, "by_slot" (default): a stable sort of the B*K reads groups
  them by destination slot (the sort and the segment boundaries are torch
  ops), then one program per (slot, column block) sums w * grad_out[bag] over
  its segment in (bag, read) order and writes the row once. No atomics, so
  two runs give bitwise-equal gradients. Dense: one program per slot of the
  table (empty segments write the zeros a dense gradient needs anyway, and
  no host sync is needed to count distinct slots). Sparse: one program per
  distinct slot read, written straight into the COO values.
- table gradient, "atomic" (for comparison only): one program per (bag,
  column block) adds w * grad_out[bag] into a float32 copy of the table with
  atomics. Order of additions varies run to run: not deterministic.
- weight gradient: one program per (bag, block of its reads):
  dot(values[idx], grad_out[bag]) over all columns.

Block sizes are heuristics (`_blocks`), not tuned on hardware yet;
bench/kernels.py sweeps a few on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALGORITHMS = ("by_slot", "atomic")


@triton.jit
def _bag_forward_kernel(values, stride_v, indices, weights, out, K, V,
                        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V  # V need not be a power of two (e.g. 96)
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        # int64 addresses: slot * stride overflows int32 beyond 2G entries.
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


@triton.jit
def _weight_grad_kernel(values, stride_v, indices, grad_out, grad_w, K, V,
                        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    bag = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < K
    idx = tl.load(indices + bag * K + ks, mask=kmask, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        cmask = cols < V
        g = tl.load(grad_out + bag * V + cols, mask=cmask, other=0.0).to(tl.float32)
        rows = tl.load(values + idx[:, None] * stride_v + cols[None, :],
                       mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(rows.to(tl.float32) * g[None, :], axis=1)
    tl.store(grad_w + bag * K + ks, acc.to(grad_w.dtype.element_ty), mask=kmask)


def _blocks(reads: int, v_dim: int, block_k: int | None = None, block_v: int | None = None) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): rows gathered per step and columns per program.
    A 16 x 256 tile keeps 16 row loads in flight per program and ~32 fp32
    accumulators per thread at 4 warps; small problems get smaller blocks so
    masked lanes do not dominate."""
    bk = block_k or min(16, triton.next_power_of_2(max(reads, 1)))
    bv = block_v or min(256, triton.next_power_of_2(max(v_dim, 1)))
    return bk, bv


def bag_forward(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                block_k: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """(N, V), (B, K), (B, K) -> (B, V) in the table's dtype."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    out = torch.empty(bags, v_dim, dtype=values.dtype, device=values.device)
    if bags == 0 or v_dim == 0:
        return out
    if reads == 0:
        return out.zero_()
    bk, bv = _blocks(reads, v_dim, block_k, block_v)
    grid = (bags, triton.cdiv(v_dim, bv))
    _bag_forward_kernel[grid](values, values.stride(0), indices, weights, out, reads, v_dim,
                              BLOCK_K=bk, BLOCK_V=bv)
    return out


def group_by_slot(indices: torch.Tensor, n_slots: int | None):
    """Sort the reads by destination slot. Returns (order, seg_start, slots):
    order (B*K,) int64 flat read ids, stably sorted by slot; seg_start the
    segment boundaries. With n_slots (dense): one segment per slot of the
    table, (n_slots + 1,), slots None. Without (sparse): one segment per
    distinct slot read, (U + 1,), and slots (U,) int64."""
    flat = indices.reshape(-1)
    # Stable: each slot's reads stay in (bag, read) order -> a fixed summation order.
    sorted_slots, order = torch.sort(flat, stable=True)
    if n_slots is not None:
        # Boundaries of every slot's segment by binary search: no atomics and
        # no host sync (the number of distinct slots is never needed).
        bounds = torch.arange(n_slots + 1, device=flat.device, dtype=sorted_slots.dtype)
        return order, torch.searchsorted(sorted_slots, bounds), None
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    seg_start = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    return order, seg_start, slots.long()


def table_grad_rows(grad_out: torch.Tensor, order: torch.Tensor, seg_start: torch.Tensor,
                    weights: torch.Tensor, reads: int, dtype: torch.dtype,
                    block_k: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """One row per segment: sum of weights * grad_out over the segment's reads."""
    segments = seg_start.numel() - 1
    v_dim = grad_out.shape[1]
    rows = torch.empty(segments, v_dim, dtype=dtype, device=grad_out.device)
    if segments == 0 or v_dim == 0:
        return rows
    bk, bv = _blocks(reads, v_dim, block_k, block_v)
    grid = (segments, triton.cdiv(v_dim, bv))
    _grad_by_slot_kernel[grid](grad_out, order, seg_start, weights, rows, rows.stride(0), reads, v_dim,
                               BLOCK_K=bk, BLOCK_V=bv)
    return rows


def table_grad_atomic(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                      grad_out: torch.Tensor, block_v: int | None = None) -> torch.Tensor:
    """Dense table gradient with float32 atomics (benchmark comparison)."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    acc = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    if bags and reads and v_dim:
        _, bv = _blocks(reads, v_dim, None, block_v)
        grid = (bags, triton.cdiv(v_dim, bv))
        _grad_atomic_kernel[grid](grad_out, indices, weights, acc, reads, v_dim, BLOCK_V=bv)
    return acc.to(values.dtype)


def weight_grad(values: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor,
                dtype: torch.dtype, block_k: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """(B, K): dot(values[indices[b, k]], grad_out[b])."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    grad_w = torch.empty(bags, reads, dtype=dtype, device=values.device)
    if bags == 0 or reads == 0:
        return grad_w
    if v_dim == 0:
        return grad_w.zero_()
    bk, bv = _blocks(reads, v_dim, block_k, block_v)
    grid = (bags, triton.cdiv(reads, bk))
    _weight_grad_kernel[grid](values, values.stride(0), indices, grad_out, grad_w, reads, v_dim,
                              BLOCK_K=bk, BLOCK_V=bv)
    return grad_w


def table_grad(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor,
               sparse: bool = False, algorithm: str = "by_slot") -> torch.Tensor:
    """The table's gradient: dense (N, V), or a coalesced sparse COO tensor of
    the rows read. Both hold the same numbers bit for bit (same segments,
    same summation order)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "atomic" and not sparse:
        return table_grad_atomic(values, indices, weights, grad_out)
    reads = indices.shape[1]
    if sparse:  # atomics have no sparse variant: a sparse result needs the grouping anyway
        order, seg_start, slots = group_by_slot(indices, None)
        rows = table_grad_rows(grad_out, order, seg_start, weights, reads, values.dtype)
        return torch.sparse_coo_tensor(slots.unsqueeze(0), rows, values.shape,
                                       is_coalesced=True, check_invariants=False)
    order, seg_start, _ = group_by_slot(indices, values.shape[0])
    return table_grad_rows(grad_out, order, seg_start, weights, reads, values.dtype)


class TritonEmbeddingBag(torch.autograd.Function):
    """The read with Triton forward and backward. Inputs as `bag_forward`."""

    @staticmethod
    def forward(ctx, values, indices, weights, sparse, algorithm):
        ctx.save_for_backward(values, indices, weights)
        ctx.sparse, ctx.algorithm = sparse, algorithm
        return bag_forward(values, indices, weights)

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_values = grad_weights = None
        if ctx.needs_input_grad[2]:
            grad_weights = weight_grad(values, indices, grad_out, weights.dtype)
        if ctx.needs_input_grad[0]:
            grad_values = table_grad(values, indices, weights, grad_out, ctx.sparse, ctx.algorithm)
        return grad_values, None, grad_weights, None, None


def embedding_bag_triton(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                         sparse: bool = False, algorithm: str = "by_slot") -> torch.Tensor:
    """The Triton read without input validation (memory.fast.ops validates)."""
    needs_grad = torch.is_grad_enabled() and (values.requires_grad or weights.requires_grad)
    if not needs_grad:
        return bag_forward(values, indices, weights)
    return TritonEmbeddingBag.apply(values, indices, weights, sparse, algorithm)
