"""The gradients of the memory read on the torch path (memory.kernel=torch), grouped by destination slot.

    y[t] = sum_k weights[t, k] * values[indices[t, k]]
    reads = sort_reads(indices, n_slots)                   # once per backward
    grad_values = dense_gradient(indices, weights, grad_y, n_slots, reads)   # (N, v_dim)
    grad_weights = weight_gradients(values, indices, grad_y, reads)           # (B, K)

See memory/fast/ops.py (the read and its custom op) for why the gradient is
computed by destination slot; memory/fast/search_grad.py reuses these for the
sub-key gradient of the search.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class ReadsBySlot(NamedTuple):
    """The B*K reads of one bag call, sorted by slot (stable): computed once
    per backward and shared by the table's and the weights' gradients."""

    slots: torch.Tensor  # (B*K,) sorted slots (int16 or int32 when the table allows)
    order: torch.Tensor  # (B*K,) int64: position of each sorted read in indices.reshape(-1)
    bag: torch.Tensor  # (B*K,) int64: the bag (token) each sorted read came from


def sort_reads(indices: torch.Tensor, n_slots: int | None = None, bags: torch.Tensor | None = None) -> ReadsBySlot:
    """Stable sort of the (B, K) reads by slot, so each slot's reads stay in
    (token, read) order and the sums over them are deterministic. Reads of
    bags of different sizes: 1-D `indices` and the bag of each read in `bags`.

    The keys are sorted in the narrowest integer type that holds the table's
    slots (`n_slots`, when given): torch's CPU sort of 262K keys takes ~11 ms
    as int64, ~8 ms as int32 and ~4 ms as int16, and a stable sort gives the
    same permutation whatever the key width. `slots` keeps that type."""
    flat = indices.reshape(-1)
    if n_slots is not None:
        for dtype in (torch.int16, torch.int32):
            if n_slots - 1 <= torch.iinfo(dtype).max:
                flat = flat.to(dtype)
                break
    slots, order = torch.sort(flat, stable=True)
    if bags is None:
        bag = torch.div(order, indices.shape[1], rounding_mode="floor")
    else:
        bag = bags.index_select(0, order)
    return ReadsBySlot(slots, order, bag)


def _permuted(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x.reshape(-1)[order], by index_select: ~3x faster on CPU than advanced indexing."""
    return x.reshape(-1).index_select(0, order)


def row_gradients(
    indices: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor, reads: ReadsBySlot | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's gradient as (slots, rows): slots (U,) int64 sorted distinct
    slots read, rows (U, v_dim) = sum of weights * grad_out over each slot's reads.

    indices, weights: (B, K); grad_out: (B, v_dim); `reads`: sort_reads(indices)
    if the caller already has it."""
    reads = sort_reads(indices) if reads is None else reads
    slots, counts = torch.unique_consecutive(reads.slots, return_counts=True)
    offsets = torch.zeros_like(counts)
    offsets[1:] = torch.cumsum(counts, 0)[:-1]
    w = _permuted(weights, reads.order).to(grad_out.dtype)
    rows = F.embedding_bag(reads.bag, grad_out, offsets, mode="sum", per_sample_weights=w)
    # int64 slots whatever the index dtype: COO tensors need them.
    return slots.long(), rows


def dense_gradient(
    indices: torch.Tensor,
    weights: torch.Tensor,
    grad_out: torch.Tensor,
    n_slots: int,
    reads: ReadsBySlot | None = None,
) -> torch.Tensor:
    """The table's gradient as a dense (n_slots, v_dim) tensor: the same bags
    as `row_gradients`, plus an empty bag (a zero row) for every slot not
    read. Bit for bit row_gradients scattered into zeros, but one pass: no
    zero-fill of the table followed by a scatter (2x faster at
    bench/kernels.py's CPU shapes)."""
    reads = sort_reads(indices, n_slots) if reads is None else reads
    every_slot = torch.arange(n_slots, dtype=reads.slots.dtype, device=reads.slots.device)
    offsets = torch.searchsorted(reads.slots, every_slot)  # where each slot's reads start
    w = _permuted(weights, reads.order).to(grad_out.dtype)
    return F.embedding_bag(reads.bag, grad_out, offsets, mode="sum", per_sample_weights=w)


# Reads the non-CPU route gathers at once: 2**26 elements (256 MB in float32).
GATHER_ELEMENTS = 1 << 26


def weight_gradients(
    values: torch.Tensor,
    indices: torch.Tensor,
    grad_out: torch.Tensor,
    reads: ReadsBySlot | None = None,
) -> torch.Tensor:
    """(B, K): d y[t] / d w[t, k] = values[indices[t, k]] . grad_y[t].

    PyTorch's fused per-sample-weights backward computes these dot products
    without gathering a (B, K, v_dim) tensor. On CPU we call it directly (aten
    op, stable since torch 1.10): this skips re-running the forward, about a
    third of this gradient's time at bench/kernels.py's shapes. Given `reads`
    (the reads sorted by slot), the dot products are taken in slot order and
    put back: each table row is then fetched once for all its reads, while
    in token order every read is a random access into the table (2-3x faster
    at bench/memory_layer.py's shapes; each dot product is the same
    computation, so the result is bit for bit the same). Elsewhere, or if the
    op's signature ever changes, `gathered_dots`."""
    bags, k = indices.shape
    if values.device.type == "cpu":
        if reads is None:
            flat, bag_of_read = indices.reshape(-1), torch.arange(bags).repeat_interleave(k)
        else:
            # The aten op takes int32/int64 indices (reads.slots may be int16).
            flat, bag_of_read = reads.slots.to(torch.promote_types(reads.slots.dtype, torch.int32)), reads.bag
        # offsets are unused in sum mode (bag_of_read says where each read goes) but typed like flat.
        offsets = torch.arange(0, bags * k, k, dtype=flat.dtype)
        try:
            dots = torch.ops.aten._embedding_bag_per_sample_weights_backward(
                grad_out, values.detach(), flat, offsets, bag_of_read.to(flat.dtype), 0, -1  # mode 0 = sum
            )
        except (AttributeError, RuntimeError, TypeError):
            pass
        else:
            if reads is None:
                return dots.view(bags, k)
            return torch.empty_like(dots).index_put_((reads.order,), dots).view(bags, k)
    return gathered_dots(values, indices, grad_out)


def gathered_dots(values: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """values (N, v_dim), indices (B, K), grad_out (B, v_dim) -> (B, K) dot
    products in float32 (or wider), by gathering the rows read, a chunk of
    tokens at a time so at most GATHER_ELEMENTS are gathered at once.

    No autograd here: the read's backward (memory/fast/ops.py) runs inside a
    custom op, where autograd is off below the dispatcher and
    torch.enable_grad() cannot turn it back on; and CUDA's per-sample-weights
    backward has no bfloat16 kernel. Both failed on an H200 (bench/device_check.sh)."""
    bags, k = indices.shape
    v_dim = values.shape[1]
    compute = torch.promote_types(torch.promote_types(values.dtype, grad_out.dtype), torch.float32)
    out = torch.empty(bags, k, dtype=compute, device=values.device)
    chunk = max(1, GATHER_ELEMENTS // max(1, k * v_dim))
    for start in range(0, bags, chunk):
        idx = indices[start:start + chunk]
        rows = values.detach().index_select(0, idx.reshape(-1)).view(idx.shape[0], k, v_dim)
        g = grad_out[start:start + chunk].to(compute).unsqueeze(-1)  # (b, v_dim, 1)
        out[start:start + chunk] = torch.bmm(rows.to(compute), g).squeeze(-1)
    return out
