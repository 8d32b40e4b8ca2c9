"""The memory read: a weighted bag of value rows per token, behind one function.

    y[t] = sum_k weights[t, k] * values[indices[t, k]]

`embedding_bag(values, indices, weights, sparse=..., kernel=...)` is the only
entry point the layers use, so faster kernels (Triton, a later issue) plug in
here without touching the layers. This file holds the plain-PyTorch kernel.

Gradient of the table. Only the rows that were read get a gradient:

    grad_values[s] = sum over (t, k) with indices[t, k] == s of weights[t, k] * grad_y[t]

We compute it "by destination slot" (MEMORY_LAYERS.md section 5): a stable
sort of the read slots groups the (t, k) pairs of each slot, and a second
embedding bag over `grad_y` sums each group. That never materializes the
(tokens * reads, v_dim) tensor of per-read gradients, and it is deterministic.
The result is `rows` (U, v_dim) for the U distinct slots read, which is
- scattered into a dense (N, v_dim) tensor (default; what torch optimizers,
  FSDP and clipping expect), or
- returned as a coalesced sparse COO tensor (`sparse=True`): indices (1, U),
  values (U, v_dim), never a dense (N, v_dim) tensor. Pair it with
  `memlm.memory.SparseRowAdamW`.
Both formats hold the same numbers, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memlm.errors import ConfigError

KERNELS = ("auto", "triton", "torch")


def available_kernels() -> list[str]:
    """Kernels this build can run. Triton kernels arrive in a later issue."""
    return ["torch"]


def resolve_kernel(kernel: str, device: torch.device | str | None = None) -> str:
    """Map the config value `memory.kernel` to a kernel that can run here.

    `auto` picks the fastest available kernel for `device`; asking for a kernel
    that is not available fails with a ConfigError naming `memory.kernel`."""
    if kernel not in KERNELS:
        raise ConfigError("memory.kernel", kernel, f"one of: {', '.join(KERNELS)}")
    if kernel == "auto":
        return "torch"
    if kernel not in available_kernels():
        raise ConfigError(
            "memory.kernel", kernel,
            f"one of the kernels available in this build: auto, {', '.join(available_kernels())}",
        )
    return kernel


def embedding_bag(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    sparse: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:
    """Weighted sum of value rows per bag.

    values: (N, v_dim) table; indices: (B, K) int64 slots; weights: (B, K),
    any float dtype (cast to the table's dtype). Returns (B, v_dim) in the
    table's dtype. `sparse=True` makes the table's gradient a coalesced sparse
    COO tensor holding only the rows read (see the module docstring)."""
    if indices.dim() != 2 or weights.shape != indices.shape:
        raise ValueError(
            f"indices and weights must both be (bags, reads), got {tuple(indices.shape)} "
            f"and {tuple(weights.shape)}"
        )
    resolve_kernel(kernel, values.device)  # only the torch kernel exists for now
    weights = weights.to(values.dtype)
    if not torch.is_grad_enabled() or not values.requires_grad:
        # Inference, or a frozen table: the weights' gradient (if any) comes
        # from PyTorch's own kernel, no custom backward needed.
        return F.embedding_bag(indices, values, per_sample_weights=weights, mode="sum")
    return _EmbeddingBag.apply(values, indices, weights, sparse)


def row_gradients(
    indices: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's gradient as (slots, rows): slots (U,) sorted distinct slots
    read, rows (U, v_dim) = sum of weights * grad_out over each slot's reads.

    indices, weights: (B, K); grad_out: (B, v_dim)."""
    reads = indices.shape[1]
    flat = indices.reshape(-1)
    # Stable sort: each slot's reads stay in (token, read) order, so the sum
    # below is deterministic.
    sorted_slots, order = torch.sort(flat, stable=True)
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    offsets = torch.zeros_like(counts)
    offsets[1:] = torch.cumsum(counts, 0)[:-1]
    bag_of_read = torch.div(order, reads, rounding_mode="floor")  # the token each read came from
    rows = F.embedding_bag(
        bag_of_read, grad_out, offsets, mode="sum",
        per_sample_weights=weights.reshape(-1)[order].to(grad_out.dtype),
    )
    return slots, rows


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
        if ctx.needs_input_grad[2]:
            # d y[t] / d w[t, k] = values[indices[t, k]] . grad_y[t]: PyTorch's
            # fused kernel computes these dot products without gathering a
            # (B, K, v_dim) tensor; re-running its cheap forward is the public
            # way to reach it.
            with torch.enable_grad():
                w = weights.detach().requires_grad_()
                y = F.embedding_bag(indices, values.detach(), per_sample_weights=w, mode="sum")
                (grad_weights,) = torch.autograd.grad(y, w, grad_out)
        if ctx.needs_input_grad[0]:
            slots, rows = row_gradients(indices, weights, grad_out)
            rows = rows.to(values.dtype)
            if ctx.sparse:
                grad_values = torch.sparse_coo_tensor(
                    slots.unsqueeze(0), rows, values.shape, is_coalesced=True, check_invariants=False
                )
            else:
                grad_values = values.new_zeros(values.shape).index_copy_(0, slots, rows)
        return grad_values, None, grad_weights, None
