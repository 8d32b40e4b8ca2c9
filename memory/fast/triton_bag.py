"""Triton kernels for the memory read (docs/memory.md, "Kernels").

    y[b] = sum_k weights[b, k] * values[indices[b, k]]          values (N, V), indices/weights (B, K)

    out = bag_forward(values, indices, weights)                          # (B, V), the table's dtype
    grad_values, grad_weights = gradients(values, indices, weights, grad_out)   # (N, V), (B, K)
    grad_weights = accumulate_gradients(values, grad_buffer, indices, weights, grad_out)  # adds into the buffer

Reached through `memlm.memory.fast.ops.embedding_bag(..., kernel="triton")` (or
`auto` on CUDA), which validates the inputs first; the launchers here assume
valid inputs: a table with unit column stride, contiguous (B, K) indices
(int32 or int64) and weights, indices in [0, N). Everything accumulates in
float32 whatever the table dtype.

The algorithm, "segments" (memory/fast/launches.py's ALGORITHMS; issue #39):
forward by whole rows: one program per block of BLOCK_B bags and
BLOCK_D >= v_dim columns (one column block up to MAX_BLOCK_D), BLOCK_K rows
gathered per step and the next step's indices loaded before this step's rows
are summed. Backward: a stable sort of the B*K reads groups them by slot
(torch ops), then one program per block of BLOCK_S segments walks each
segment in (bag, read) order: it sums w * grad_out[bag] into the slot's row
(written once, or added into the table's gradient buffer; an empty segment
writes its zero row, or leaves the buffer's) and, from the same grad_out rows
and the slot's value row (read once per slot, not once per read), writes
each read's weight gradient. No atomics: two runs give bitwise-equal
gradients. The segments go to programs in slot order, or longest first
(Launch.busiest_first: a few hot slots then start first, one per program).

Launches come from memory/fast/launches.py (the run's config, a measured
table, or a rule); `launch=` overrides them (bench/gpu_speed.py's sweep). The
first kernels ("by_slot", "atomic") are kept for comparison in
bench/bag_variants.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from memlm.memory.fast.launches import Launch, block_d, forward_launch, next_pow2, segments_launch

# Offsets at or beyond this need int64 arithmetic.
INT32_LIMIT = 2**31


# ---------------------------------------------------------------- "segments"
@triton.jit
def _rows_forward_kernel(values, stride_v, indices, weights, out, B, K, V,
                         BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                         WIDE: tl.constexpr):
    # Program (p, c): bags [p * BLOCK_B, +BLOCK_B), columns [c * BLOCK_D, +BLOCK_D).
    # WIDE: some offset (slot * stride, bag * K, bag * V) reaches 2**31 -> int64.
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    bags = pid * BLOCK_B + tl.arange(0, BLOCK_B)                      # (BB,)
    bmask = bags < B
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)         # (BD,)
    cmask = cols < V                                                  # V need not be a power of two
    ks = tl.arange(0, BLOCK_K)                                        # (BK,)
    base = bags[:, None] * K                                          # (BB, 1) first read of each bag
    kmask = bmask[:, None] & (ks[None, :] < K)                        # (BB, BK)
    idx = tl.load(indices + base + ks[None, :], mask=kmask, other=0)
    w = tl.load(weights + base + ks[None, :], mask=kmask, other=0.0)
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if WIDE:
            row = idx.to(tl.int64) * stride_v
        else:
            row = idx.to(tl.int32) * stride_v
        rows = tl.load(values + row[:, :, None] + cols[None, None, :],  # (BB, BK, BD)
                       mask=kmask[:, :, None] & cmask[None, None, :], other=0.0)
        # The next step's indices and weights, in flight while these rows are summed.
        nks = k0 + BLOCK_K + ks
        nmask = bmask[:, None] & (nks[None, :] < K)
        nidx = tl.load(indices + base + nks[None, :], mask=nmask, other=0)
        nw = tl.load(weights + base + nks[None, :], mask=nmask, other=0.0)
        acc += tl.sum(rows.to(tl.float32) * w.to(tl.float32)[:, :, None], axis=1)
        idx, w, kmask = nidx, nw, nmask
    tl.store(out + bags[:, None] * V + cols[None, :], acc.to(out.dtype.element_ty),
             mask=bmask[:, None] & cmask[None, :])


@triton.jit
def _segments_kernel(grad_out, values, stride_v, order, seg_start, slots, weights, grad_rows, stride_r, grad_w,
                     seg_order, S, K, V,
                     BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                     DENSE: tl.constexpr, FUSE_W: tl.constexpr, WIDE: tl.constexpr,
                     ACCUMULATE: tl.constexpr, ORDERED: tl.constexpr):
    # Program (p, c) owns segments [p * BLOCK_S, +BLOCK_S) of the sorted reads (ORDERED:
    # segments seg_order[p + j * programs], j < BLOCK_S: the longest first, one per program),
    # columns [c * BLOCK_D, +BLOCK_D); segment s = reads order[seg_start[s]:seg_start[s+1]]
    # (flat ids bag * K + k), all of slot s (DENSE) or slots[s]. It writes row s of
    # grad_rows and, with FUSE_W (one column block covers V), grad_w of those reads.
    # ACCUMULATE (with DENSE): grad_rows is the table's gradient buffer; a read
    # slot's row gets its sum added (row + sum, rounded once), an unread slot's
    # row is not touched.
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)         # (BD,)
    cmask = cols < V
    js0 = tl.arange(0, BLOCK_K)                                       # (BK,)
    if ORDERED:
        lo = tl.program_id(0).to(tl.int64)                            # int64 segment ids: seg * stride
        hi = S
        step = tl.num_programs(0).to(tl.int64)
    else:
        lo = tl.program_id(0).to(tl.int64) * BLOCK_S
        hi = tl.minimum(lo + BLOCK_S, S)
        step = 1
    for i in range(lo, hi, step):
        if ORDERED:
            seg = tl.load(seg_order + i).to(tl.int64)
        else:
            seg = i
        start = tl.load(seg_start + seg)
        end = tl.load(seg_start + seg + 1)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        if FUSE_W:
            if DENSE:
                slot = seg
            else:
                slot = tl.load(slots + seg).to(tl.int64)
            vrow = tl.zeros((BLOCK_D,), dtype=tl.float32)
            if end > start:  # an empty segment reads nothing
                vrow = tl.load(values + slot * stride_v + cols, mask=cmask, other=0.0).to(tl.float32)
        for j0 in range(start, end, BLOCK_K):
            js = j0 + js0
            jmask = js < end
            read = tl.load(order + js, mask=jmask, other=0)
            w = tl.load(weights + read, mask=jmask, other=0.0).to(tl.float32)
            bag = read // K
            if WIDE:
                bag = bag.to(tl.int64)
            g = tl.load(grad_out + bag[:, None] * V + cols[None, :],      # (BK, BD)
                        mask=jmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(g * w[:, None], axis=0)
            if FUSE_W:
                tl.store(grad_w + read, tl.sum(g * vrow[None, :], axis=1).to(grad_w.dtype.element_ty), mask=jmask)
        # Scalar base first: the per-column offsets stay int32.
        if ACCUMULATE:
            if end > start:
                held = tl.load(grad_rows + seg * stride_r + cols, mask=cmask, other=0.0).to(tl.float32)
                tl.store(grad_rows + seg * stride_r + cols, (held + acc).to(grad_rows.dtype.element_ty),
                         mask=cmask)
        else:
            tl.store(grad_rows + seg * stride_r + cols, acc.to(grad_rows.dtype.element_ty), mask=cmask)


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


# ------------------------------------------------------------ launchers
def _wide(*extents: int) -> bool:
    """Whether an offset can reach 2**31 (then int64 address math)."""
    return max(extents) >= INT32_LIMIT


# ---------------------------------------------------------------- forward
def bag_forward(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                launch: Launch | None = None, configured: Sequence[int] = ()) -> torch.Tensor:
    """(N, V), (B, K), (B, K) -> (B, V) in the table's dtype. `launch`
    overrides the forward's (bench/gpu_speed.py's sweep); `configured` is the
    model's memory.triton_forward (memory/fast/launches.py)."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    out = torch.empty(bags, v_dim, dtype=values.dtype, device=values.device)
    if bags == 0 or v_dim == 0:
        return out
    if reads == 0:
        return out.zero_()
    cfg = launch or forward_launch(v_dim, reads, bags, values.dtype, configured)
    wide = _wide(values.shape[0] * values.stride(0), bags * reads, bags * v_dim)
    grid = (triton.cdiv(bags, cfg.block_b), triton.cdiv(v_dim, cfg.block_d))
    _rows_forward_kernel[grid](values, values.stride(0), indices, weights, out, bags, reads, v_dim,
                               BLOCK_B=cfg.block_b, BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d, WIDE=wide,
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)
    return out


# ---------------------------------------------------------------- backward
def group_by_slot(indices: torch.Tensor, n_slots: int, dense: bool = True):
    """Sort the reads by destination slot. Returns (order, seg_start, slots):
    order (B*K,) flat read ids, stably sorted by slot; seg_start the segment
    boundaries. Dense: one segment per slot of the table, (n_slots + 1,),
    slots None. Sparse: one segment per distinct slot read, (U + 1,), and
    slots (U,) int64. Keys and ids are int32 when they fit (a radix sort
    then makes half the passes; a stable sort gives the same permutation
    whatever the key width), else int64."""
    flat = indices.reshape(-1)
    narrow = n_slots <= INT32_LIMIT and flat.numel() < INT32_LIMIT
    if narrow:
        flat = flat.to(torch.int32)
    # Stable: each slot's reads stay in (bag, read) order -> a fixed summation order.
    sorted_slots, order = torch.sort(flat, stable=True)
    order = order.to(torch.int32) if narrow else order
    if dense:
        # Boundaries of every slot's segment by binary search: no atomics and
        # no host sync (the number of distinct slots is never needed).
        bounds = torch.arange(n_slots + 1, device=flat.device, dtype=sorted_slots.dtype)
        return order, torch.searchsorted(sorted_slots, bounds, out_int32=narrow), None
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    seg_start = torch.zeros(counts.numel() + 1, dtype=order.dtype, device=flat.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    return order, seg_start, slots.long()


def segment_gradients(values: torch.Tensor, grad_out: torch.Tensor, order: torch.Tensor, seg_start: torch.Tensor,
                      slots: torch.Tensor | None, weights: torch.Tensor, need_weights: bool,
                      launch: Launch | None = None, into: torch.Tensor | None = None,
                      configured: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The "segments" walk: (rows (S, V) in the table's dtype, one per segment,
    and the weights' gradient (B, K) when `need_weights` and one column block
    covers V, else None). `slots` None: segment s is slot s (dense).
    `into` (dense only): the table's gradient buffer (N, V), contiguous rows;
    each read slot's sum is added to its row there (unread rows untouched),
    and `into` is returned as the rows."""
    bags, reads = weights.shape
    segments = seg_start.numel() - 1
    v_dim = values.shape[1]
    if into is not None and (slots is not None or into.shape != values.shape or into.stride(1) != 1):
        raise ValueError(f"accumulating needs a dense grouping and a (N, V) buffer with unit column stride, "
                         f"got shape {tuple(into.shape)}, strides {into.stride()}")
    rows = into if into is not None else torch.empty(segments, v_dim, dtype=values.dtype, device=values.device)
    cfg = launch or segments_launch(v_dim, values.dtype, configured)  # configured: memory.triton_backward
    fuse = need_weights and triton.cdiv(v_dim, cfg.block_d) == 1
    grad_w = torch.empty(bags, reads, dtype=weights.dtype, device=values.device) if fuse else None
    if segments == 0 or v_dim == 0:
        return rows, (grad_w.zero_() if fuse else None)
    wide = _wide(bags * v_dim, bags * reads)
    grid = (triton.cdiv(segments, cfg.block_b), triton.cdiv(v_dim, cfg.block_d))
    # busiest_first: segment ids by decreasing length (stable: ties in slot order).
    seg_order = torch.argsort(seg_start.diff(), descending=True, stable=True) if cfg.busiest_first else seg_start
    _segments_kernel[grid](grad_out, values, values.stride(0), order, seg_start,
                           seg_start if slots is None else slots, weights, rows, rows.stride(0),
                           grad_w if fuse else weights, seg_order, segments, reads, v_dim,
                           BLOCK_S=cfg.block_b, BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d,
                           DENSE=slots is None, FUSE_W=fuse, WIDE=wide, ACCUMULATE=into is not None,
                           ORDERED=cfg.busiest_first,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)
    return rows, grad_w


def weight_grad(values: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor,
                dtype: torch.dtype, block_k: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """(B, K): dot(values[indices[b, k]], grad_out[b]), one program per (bag,
    block of BLOCK_K reads, default up to 16), BLOCK_V columns a step (default
    whole rows); used only where the segments walk cannot fuse it (the table
    needs no gradient, or V spans several column blocks)."""
    bags, reads = indices.shape
    v_dim = values.shape[1]
    grad_w = torch.empty(bags, reads, dtype=dtype, device=values.device)
    if bags == 0 or reads == 0:
        return grad_w
    if v_dim == 0:
        return grad_w.zero_()
    bk, bv = block_k or min(16, next_pow2(reads)), block_v or block_d(v_dim)
    grid = (bags, triton.cdiv(reads, bk))
    _weight_grad_kernel[grid](values, values.stride(0), indices, grad_out, grad_w, reads, v_dim,
                              BLOCK_K=bk, BLOCK_V=bv)
    return grad_w


def _as_table_gradient(rows: torch.Tensor, slots: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """Dense rows as they are; sparse ones as a coalesced COO tensor."""
    if slots is None:
        return rows
    return torch.sparse_coo_tensor(slots.unsqueeze(0), rows, shape, is_coalesced=True, check_invariants=False)


def gradients(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor,
              sparse: bool = False, need_values: bool = True,
              need_weights: bool = True,
              configured: Sequence[int] = ()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(table gradient or None, weights' gradient or None) of one read. The
    table's is dense (N, V), or with `sparse` a coalesced COO tensor of the
    rows read; both hold the same numbers bit for bit (same segments, same
    summation order). grad_out (B, V) contiguous."""
    if not need_values:
        return None, (weight_grad(values, indices, grad_out, weights.dtype) if need_weights else None)
    order, seg_start, slots = group_by_slot(indices, values.shape[0], dense=not sparse)
    rows, grad_weights = segment_gradients(values, grad_out, order, seg_start, slots, weights, need_weights,
                                           configured=configured)
    if need_weights and grad_weights is None:  # V wider than one column block
        grad_weights = weight_grad(values, indices, grad_out, weights.dtype)
    return _as_table_gradient(rows, slots, values.shape), grad_weights


def accumulate_gradients(values: torch.Tensor, into: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                         grad_out: torch.Tensor, need_weights: bool = True,
                         launch: Launch | None = None, configured: Sequence[int] = ()) -> torch.Tensor | None:
    """The table's gradient of one read added into `into` (its (N, V)
    gradient buffer: every read of a step accumulates there, rows not read
    are not touched), and the weights' gradient (B, K) if `need_weights`.
    The "segments" walk over a dense grouping: no sync, no atomics, each
    row summed in (bag, read) order, so two runs are bitwise equal."""
    order, seg_start, _ = group_by_slot(indices, values.shape[0], dense=True)
    _, grad_weights = segment_gradients(values, grad_out, order, seg_start, None, weights, need_weights, launch,
                                        into=into, configured=configured)
    if need_weights and grad_weights is None:  # V wider than one column block
        grad_weights = weight_grad(values, indices, grad_out, weights.dtype)
    return grad_weights
