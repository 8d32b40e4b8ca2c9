"""The memory read: a weighted bag of value rows per token, behind one function.

    y[t] = sum_k weights[t, k] * values[indices[t, k]]

`embedding_bag(values, indices, weights, sparse=..., kernel=...)` is the only
entry point the layers use: it validates the inputs and dispatches by device
and `memory.kernel` to the Triton kernels (memory/triton_bag.py, CUDA) or the
plain-PyTorch kernel held in this file (CPU).

Gradient of the table. Only the rows that were read get a gradient:

    grad_values[s] = sum over (t, k) with indices[t, k] == s of weights[t, k] * grad_y[t]

We compute it "by destination slot" (MEMORY_LAYERS.md section 5): a stable
sort of the read slots groups the (t, k) pairs of each slot, and a second
embedding bag over `grad_y` sums each group. The same sort orders the dot
products of the weights' gradient, so that each table row is fetched once. That never materializes the
(tokens * reads, v_dim) tensor of per-read gradients, and it is deterministic.
The gradient is
- a dense (N, v_dim) tensor (default; what torch optimizers, FSDP and
  clipping expect): one bag per slot of the table, empty (zero) for slots
  not read, written in one pass, or
- a coalesced sparse COO tensor (`sparse=True`): one bag per distinct slot
  read, indices (1, U), values (U, v_dim), never a dense (N, v_dim) tensor.
  Pair it with `memlm.memory.SparseRowAdamW`.
Both formats hold the same numbers, bit for bit (same bags, same order).
The Triton kernels (memory/triton_bag.py) use the same grouping.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from memlm.errors import ConfigError

KERNELS = ("auto", "triton", "torch")
# TRITON_INTERPRET=1 runs Triton kernels on CPU tensors through Triton's
# interpreter: slow, for tests only. Triton reads it when a kernel is defined
# (memory/triton_bag.py is imported), so it must be set before that.
INTERPRET_ENV = "TRITON_INTERPRET"
# On CUDA, a synchronous bounds check (raising IndexError) costs a host sync
# per read; it runs only when this is set to 1 (see _check_indices).
CHECK_INDICES_ENV = "MEMLM_CHECK_INDICES"
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_importable() -> bool:
    # find_spec, not import: importing triton costs startup time and would fix
    # the interpreter choice for the whole process.
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def _triton_runs_on(device: torch.device) -> bool:
    if not _triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_kernels(device: torch.device | str | None = None) -> list[str]:
    """Kernels that can run on `device` (default: CUDA if present, else CPU).
    `triton` needs the triton package and a CUDA tensor, or TRITON_INTERPRET=1
    for CPU tensors (tests)."""
    device = _default_device() if device is None else torch.device(device)
    return ["torch", "triton"] if _triton_runs_on(device) else ["torch"]


def resolve_kernel(kernel: str, device: torch.device | str | None = None) -> str:
    """Map the config value `memory.kernel` to a kernel that can run here.

    `auto` picks `triton` for CUDA tensors when triton is importable, else
    `torch` (CPU tensors always get `torch`: the interpreter is for tests).
    `device=None` means the default device (CUDA if present, else CPU).
    Asking for a kernel that cannot run there fails with a ConfigError naming
    `memory.kernel`."""
    if kernel not in KERNELS:
        raise ConfigError("memory.kernel", kernel, f"one of: {', '.join(KERNELS)}")
    device = _default_device() if device is None else torch.device(device)
    if kernel == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if kernel not in available_kernels(device):
        why = ("triton is not installed" if not _triton_importable() else
               f"{device.type} tensors need CUDA, or {INTERPRET_ENV}=1 (the slow interpreter, for tests)")
        raise ConfigError(
            "memory.kernel", kernel,
            f"auto or torch ({kernel} cannot run on {device.type} here: {why})",
        )
    return kernel


def _check_inputs(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> None:
    """Shapes, dtypes and devices: metadata only, no kernel launched."""
    if values.dim() != 2:
        raise ValueError(f"values must be a (slots, v_dim) table, got shape {tuple(values.shape)}")
    if indices.dim() != 2 or weights.shape != indices.shape:
        raise ValueError(
            f"indices and weights must both be (bags, reads), got {tuple(indices.shape)} "
            f"and {tuple(weights.shape)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
    if not values.dtype.is_floating_point or not weights.dtype.is_floating_point:
        raise ValueError(f"values and weights must be floating point, got {values.dtype} and {weights.dtype}")
    if not (values.device == indices.device == weights.device):
        raise ValueError(
            f"values, indices and weights must be on one device, got {values.device}, "
            f"{indices.device}, {weights.device}"
        )


def _check_indices(indices: torch.Tensor, n_slots: int) -> None:
    """Every index in [0, n_slots).

    CPU: always, synchronously (one min/max pass over the B*K indices, small
    next to reading B*K rows). CUDA: reading min/max on the host would stall
    the stream once per read, so by default the check is a device-side
    assertion (torch._assert_async: no sync; a bad index stops the program at
    the next synchronization with a device-side assert instead of reading
    another row's memory). MEMLM_CHECK_INDICES=1 makes the CUDA check
    synchronous too, raising the IndexError below (for debugging)."""
    if indices.numel() == 0:
        return
    lo, hi = torch.aminmax(indices)
    if indices.device.type == "cuda" and os.environ.get(CHECK_INDICES_ENV, "0") != "1":
        torch._assert_async((lo >= 0) & (hi < n_slots))
        return
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= n_slots:
        raise IndexError(
            f"memory read index out of range: indices span [{lo}, {hi}], the table has "
            f"{n_slots} slots (valid: 0..{n_slots - 1})"
        )


# Eager under torch.compile: the read dispatches to hand-written kernels with
# their own backward, and checks its indices on the host. Disabling tracing
# here (and in the search, usage counting and pool read) splits a compiled
# block around the memory kernels: the rest of the block (projections, norms,
# gating) is still compiled and fused (the ablation runs use this).
@torch.compiler.disable
def embedding_bag(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    sparse: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:
    """Weighted sum of value rows per bag.

    values: (N, v_dim) table; indices: (B, K) int32/int64 slots in [0, N);
    weights: (B, K), any float dtype. Returns (B, v_dim) in the table's dtype.
    `sparse=True` makes the table's gradient a coalesced sparse COO tensor
    holding only the rows read (see the module docstring).

    `kernel` (memory.kernel) is resolved per call for the tensors' device:
    `auto` -> Triton on CUDA, this file's PyTorch path on CPU. The Triton path
    accumulates in float32 and keeps the weights in their own dtype; it needs
    a table with unit column stride (copying a large table behind the
    caller's back would double its memory, so it is an error) and copies
    non-contiguous indices/weights (small)."""
    _check_inputs(values, indices, weights)
    kernel = resolve_kernel(kernel, values.device)
    _check_indices(indices, values.shape[0])
    if kernel == "triton":
        if values.dtype not in TRITON_DTYPES:
            raise ValueError(f"the triton kernel reads float32/bfloat16/float16 tables, got {values.dtype}; "
                             "use memory.kernel=torch")
        if values.shape[1] > 1 and values.stride(1) != 1:
            raise ValueError(f"the table must be contiguous along v_dim (strides {values.stride()}); "
                             "pass values.contiguous()")
        from memlm.memory.triton_bag import embedding_bag_triton  # imports triton only when used

        return embedding_bag_triton(values, indices.contiguous(), weights.contiguous(), sparse=sparse)
    weights = weights.to(values.dtype)
    if not torch.is_grad_enabled() or not values.requires_grad:
        # Inference, or a frozen table: the weights' gradient (if any) comes
        # from PyTorch's own kernel, no custom backward needed.
        return F.embedding_bag(indices, values, per_sample_weights=weights, mode="sum")
    return _EmbeddingBag.apply(values, indices, weights, sparse)


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


def weight_gradients(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
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
    op's signature ever changes, the public route re-runs the cheap forward
    under autograd."""
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
    with torch.enable_grad():
        w = weights.detach().requires_grad_()
        y = F.embedding_bag(indices, values.detach(), per_sample_weights=w, mode="sum")
        (grad_weights,) = torch.autograd.grad(y, w, grad_out)
    return grad_weights


class _EmbeddingBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, weights, sparse):
        # values: (N, v_dim); indices, weights: (B, K) -> (B, v_dim)
        ctx.save_for_backward(values, indices, weights)
        ctx.sparse = sparse
        return F.embedding_bag(indices, values, per_sample_weights=weights, mode="sum")

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_values = grad_weights = None
        reads = sort_reads(indices, values.shape[0])  # one sort for both gradients
        if ctx.needs_input_grad[2]:
            grad_weights = weight_gradients(values, indices, weights, grad_out, reads)
        if ctx.needs_input_grad[0]:
            if ctx.sparse:
                slots, rows = row_gradients(indices, weights, grad_out, reads)
                grad_values = torch.sparse_coo_tensor(
                    slots.unsqueeze(0), rows.to(values.dtype), values.shape,
                    is_coalesced=True, check_invariants=False,
                )
            else:
                grad_values = dense_gradient(indices, weights, grad_out, values.shape[0], reads).to(values.dtype)
        return grad_values, None, grad_weights, None
