"""The memory read: a weighted bag of value rows per token, behind one function.

    y[t] = sum_k weights[t, k] * values[indices[t, k]]

`embedding_bag(values, indices, weights, sparse=..., kernel=...)` is the only
entry point the layers use: it validates the inputs and dispatches by device
and `memory.kernel` to the Triton kernels (memory/fast/triton_bag.py, CUDA) or the
plain-PyTorch kernel (CPU: F.embedding_bag forward, memory/fast/bag_grad.py backward).
The read is registered as the custom ops `memlm::embedding_bag` and
`memlm::embedding_bag_backward` (torch.library): torch.compile sees one
opaque, differentiable op (shapes from its fake kernel) and traces a memory
layer without a graph break.

Gradient of the table. Only the rows that were read get a gradient:

    grad_values[s] = sum over (t, k) with indices[t, k] == s of weights[t, k] * grad_y[t]

We compute it "by destination slot" (docs/memory.md, "Kernels"): a stable
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
The Triton kernels (memory/fast/triton_bag.py) use the same grouping, and
take both gradients in one walk of it.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from memlm.errors import ConfigError

# The CPU gradients (memory/fast/bag_grad.py), re-exported: tests and the search's backward import them from here.
from memlm.memory.fast.bag_grad import (
    ReadsBySlot,
    dense_gradient,
    row_gradients,
    sort_reads,
    weight_gradients,
)
from memlm.memory.fast.launches import NO_LAUNCHES, ReadLaunches

__all__ = ["KERNELS", "ReadsBySlot", "available_kernels", "dense_gradient", "embedding_bag", "resolve_kernel",
           "row_gradients", "sort_reads", "weight_gradients"]

# memory.kernel's choices (memlm.memory.config takes them from here: memory/fast/ sits below it).
KERNELS = ("auto", "triton", "torch")
# TRITON_INTERPRET=1 runs Triton kernels on CPU tensors through Triton's
# interpreter: slow, for tests only. Triton reads it when a kernel is defined
# (memory/fast/triton_bag.py is imported), so it must be set before that.
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


def embedding_bag(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    sparse: bool = False,
    kernel: str = "auto",
    grad_into: torch.Tensor | None = None,
    launches: ReadLaunches = NO_LAUNCHES,
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
    non-contiguous indices/weights (small).

    Under torch.compile the read is one opaque op, `memlm::embedding_bag`
    (and `memlm::embedding_bag_backward`): no graph break. A sparse read
    runs eagerly (a graph break): its gradient is a sparse tensor of
    data-dependent size, which compiled graphs do not carry.

    `grad_into` (a dense (N, v_dim) buffer of the table's dtype, usually
    `values.grad`): the backward adds the table's gradient into it, touching
    only the rows read, and hands autograd no gradient for `values`. Every
    read of a shared table then accumulates into one buffer: no dense
    per-read gradient, no autograd sum of them (`_ReadInto`).

    `launches` (memory.triton_forward / triton_backward, memory/fast/launches.py):
    the Triton launches of this read's passes; empty lists keep the measured or
    rule's launches. The torch path ignores them."""
    _check_inputs(values, indices, weights)
    if sparse:
        if grad_into is not None:
            raise ValueError("grad_into takes a dense gradient; a sparse read's gradient is a COO tensor")
        return _sparse_read(values, indices, weights, kernel, launches)
    fwd, bwd = list(launches.forward), list(launches.backward)
    if grad_into is not None:
        if grad_into.shape != values.shape or grad_into.dtype != values.dtype or grad_into.is_sparse:
            raise ValueError(f"grad_into must be a dense {tuple(values.shape)} {values.dtype} tensor like the "
                             f"table, got {tuple(grad_into.shape)} {grad_into.dtype}")
        return _ReadInto.apply(values, grad_into, indices, weights, kernel, fwd, bwd)
    return torch.ops.memlm.embedding_bag(values, indices, weights, False, kernel, fwd, bwd)


@torch.compiler.disable
def _sparse_read(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, kernel: str,
                 launches: ReadLaunches) -> torch.Tensor:
    return torch.ops.memlm.embedding_bag(values, indices, weights, True, kernel, list(launches.forward),
                                         list(launches.backward))


def _resolve_for(values: torch.Tensor, kernel: str) -> str:
    """resolve_kernel plus the Triton kernel's demands on the table (inside
    the op: at run time, so that tracing never touches the environment)."""
    kernel = resolve_kernel(kernel, values.device)
    if kernel == "triton":
        if values.dtype not in TRITON_DTYPES:
            raise ValueError(f"the triton kernel reads float32/bfloat16/float16 tables, got {values.dtype}; "
                             "use memory.kernel=torch")
        if values.shape[1] > 1 and values.stride(1) != 1:
            raise ValueError(f"the table must be contiguous along v_dim (strides {values.stride()}); "
                             "pass values.contiguous()")
    return kernel


@torch.library.custom_op("memlm::embedding_bag", mutates_args=())
def _bag_op(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, sparse: bool,
            kernel: str, fwd: list[int], bwd: list[int]) -> torch.Tensor:
    # values: (N, v_dim); indices, weights: (B, K) -> (B, v_dim) in the table's dtype
    kernel = _resolve_for(values, kernel)
    _check_indices(indices, values.shape[0])
    if kernel == "triton":
        from memlm.memory.fast.triton_bag import bag_forward  # imports triton only when used

        return bag_forward(values, indices.contiguous(), weights.contiguous(), configured=fwd)
    return F.embedding_bag(indices, values, per_sample_weights=weights.to(values.dtype), mode="sum")


@_bag_op.register_fake
def _(values, indices, weights, sparse, kernel, fwd, bwd):
    return values.new_empty(indices.shape[0], values.shape[1])


def _bag_gradients(grad_out, values, indices, weights, sparse, kernel, need_values, need_weights, bwd=()):
    """(table gradient or None, weights gradient or None) of one read; the
    table's is a coalesced sparse COO tensor if `sparse`."""
    kernel = _resolve_for(values, kernel)
    grad_out = grad_out.contiguous()
    grad_values = grad_weights = None
    if kernel == "triton":
        from memlm.memory.fast.triton_bag import gradients  # one walk of the sorted reads gives both

        return gradients(values, indices.contiguous(), weights.contiguous(), grad_out, sparse, need_values,
                         need_weights, configured=bwd)
    w = weights.to(values.dtype)  # what the forward read with (the cast's backward casts back)
    # One sort for both gradients; the weights' alone need none.
    reads = sort_reads(indices, values.shape[0]) if need_values else None
    if need_weights:
        grad_weights = weight_gradients(values, indices, grad_out, reads).to(weights.dtype)
    if need_values:
        if sparse:
            slots, rows = row_gradients(indices, w, grad_out, reads)
            grad_values = torch.sparse_coo_tensor(
                slots.unsqueeze(0), rows.to(values.dtype), values.shape, is_coalesced=True, check_invariants=False,
            )
        else:
            grad_values = dense_gradient(indices, w, grad_out, values.shape[0], reads).to(values.dtype)
    return grad_values, grad_weights


@torch.library.custom_op("memlm::embedding_bag_backward", mutates_args=())
def _bag_backward_op(grad_out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                     kernel: str, need_values: bool, need_weights: bool,
                     bwd: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense gradients of the table (N, v_dim) and the weights (B, K); a
    gradient not asked for comes back as an empty tensor (an op returns tensors)."""
    gv, gw = _bag_gradients(grad_out, values, indices, weights, False, kernel, need_values, need_weights, bwd)
    # Contiguous, as the fake kernel promises.
    return ((values.new_empty(0) if gv is None else gv.contiguous()),
            (weights.new_empty(0) if gw is None else gw.contiguous()))


@_bag_backward_op.register_fake
def _(grad_out, values, indices, weights, kernel, need_values, need_weights, bwd):
    gv = values.new_empty(values.shape) if need_values else values.new_empty(0)
    return gv, (weights.new_empty(weights.shape) if need_weights else weights.new_empty(0))


def _bag_setup_context(ctx, inputs, output):
    values, indices, weights, sparse, kernel, fwd, bwd = inputs
    ctx.save_for_backward(values, indices, weights)
    ctx.sparse, ctx.kernel, ctx.bwd = sparse, kernel, bwd


def _bag_backward(ctx, grad_out):
    values, indices, weights = ctx.saved_tensors
    need_values, _, need_weights = ctx.needs_input_grad[:3]
    if ctx.sparse:  # eager only (see embedding_bag)
        gv, gw = _bag_gradients(grad_out, values, indices, weights, True, ctx.kernel, need_values, need_weights,
                                ctx.bwd)
    else:
        gv, gw = torch.ops.memlm.embedding_bag_backward(grad_out, values, indices, weights, ctx.kernel,
                                                         need_values, need_weights, ctx.bwd)
    return (gv if need_values else None), None, (gw if need_weights else None), None, None, None, None


_bag_op.register_autograd(_bag_backward, setup_context=_bag_setup_context)


# ------------------------------------------------- reads that accumulate into a buffer
class _ReadInto(torch.autograd.Function):
    """The plain read op forward (it takes the table, not the buffer); the
    backward adds the table's gradient into `grad_into` and gives the table
    none. An autograd.Function rather than a custom op's autograd: the
    buffer rides on ctx, so the forward op never takes it."""

    @staticmethod
    def forward(ctx, values, grad_into, indices, weights, kernel, fwd, bwd):
        ctx.save_for_backward(values, indices, weights)
        # Not saved as a tensor for backward: every read's backward writes it,
        # and the version check of saved tensors would refuse the second one.
        ctx.grad_into, ctx.kernel, ctx.bwd = grad_into, kernel, bwd
        return torch.ops.memlm.embedding_bag(values, indices, weights, False, kernel, fwd, bwd)

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, weights = ctx.saved_tensors
        need_values, _, _, need_weights = ctx.needs_input_grad[:4]
        gw = None
        if need_values:
            gw = torch.ops.memlm.embedding_bag_accumulate_(grad_out, values, ctx.grad_into, indices, weights,
                                                            ctx.kernel, need_weights, ctx.bwd)
        elif need_weights:
            _, gw = torch.ops.memlm.embedding_bag_backward(grad_out, values, indices, weights, ctx.kernel, False,
                                                            True, ctx.bwd)
        return None, None, None, (gw if need_weights else None), None, None, None


def _accumulate(grad_out, values, grad_into, indices, weights, kernel, need_weights, bwd=()):
    """Add the table's gradient of one read into `grad_into` (rows read only);
    return the weights' gradient or None. The same bags in the same order as
    `_bag_gradients`, so a buffer that starts at zero ends bit for bit at
    the sum autograd would form of the reads' dense gradients (fp32 tables)."""
    kernel = _resolve_for(values, kernel)
    grad_out = grad_out.contiguous()
    if kernel == "triton":
        from memlm.memory.fast.triton_bag import accumulate_gradients

        return accumulate_gradients(values, grad_into, indices.contiguous(), weights.contiguous(), grad_out,
                                    need_weights, configured=bwd)
    reads = sort_reads(indices, values.shape[0])
    grad_weights = weight_gradients(values, indices, grad_out, reads).to(weights.dtype) if need_weights else None
    slots, rows = row_gradients(indices, weights.to(values.dtype), grad_out, reads)
    grad_into.index_add_(0, slots, rows.to(grad_into.dtype))  # distinct slots: one add per row read
    return grad_weights


@torch.library.custom_op("memlm::embedding_bag_accumulate_", mutates_args=("grad_into",))
def _bag_accumulate_op(grad_out: torch.Tensor, values: torch.Tensor, grad_into: torch.Tensor,
                       indices: torch.Tensor, weights: torch.Tensor, kernel: str,
                       need_weights: bool, bwd: list[int]) -> torch.Tensor:
    """Adds the table's gradient into `grad_into`; returns the weights'
    gradient (B, K), or an empty tensor when not asked for."""
    gw = _accumulate(grad_out, values, grad_into, indices, weights, kernel, need_weights, bwd)
    return weights.new_empty(0) if gw is None else gw.contiguous()


@_bag_accumulate_op.register_fake
def _(grad_out, values, grad_into, indices, weights, kernel, need_weights, bwd):
    return weights.new_empty(weights.shape) if need_weights else weights.new_empty(0)
