"""`row_dots`: the dot product of each row a bag reads with that bag's vector.

    out[b, k] = table[indices[b, k]] . x[b]

The transpose of the memory read (`memlm.memory.fast.ops.embedding_bag`), and
PEER's down projection: u_i . x for the experts i a token retrieved.
Autograd through `F.embedding(indices, table)` and a batched matmul would
materialize the (B, K, dim) gather and its gradient (at PEER's published
sizes, 8 heads x 16 experts on 2048-wide tokens, 4 GB per 8K bf16 tokens);
here nothing of that size is formed, with the read's own building blocks:

    forward     out[b, k]      = table[indices[b, k]] . x[b]      dot products in slot order (ops.weight_gradients)
    grad x      grad_x[b]      = sum_k g[b, k] table[indices[b, k]]   an embedding bag
    grad table  grad_table[s]  = sum over the reads of s of g * x[b]  by destination slot (ops.dense_gradient)

One stable sort of the reads by slot serves the forward and the table's
gradient; the results are deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memlm.memory.fast.ops import ReadsBySlot, dense_gradient, sort_reads, weight_gradients


class _RowDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, indices, x):
        # table (N, dim); indices (B, K); x (B, dim) -> (B, K)
        reads = sort_reads(indices, table.shape[0])
        out = weight_gradients(table, indices, x.to(table.dtype).contiguous(), reads)
        ctx.save_for_backward(table, indices, x, *reads)
        return out.to(torch.promote_types(table.dtype, x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        table, indices, x, *saved = ctx.saved_tensors
        reads = ReadsBySlot(*saved)
        g = grad_out.contiguous()
        grad_table = grad_x = None
        if ctx.needs_input_grad[2]:
            grad_x = F.embedding_bag(indices, table, per_sample_weights=g.to(table.dtype), mode="sum").to(x.dtype)
        if ctx.needs_input_grad[0]:
            grad_table = dense_gradient(indices, g.to(x.dtype), x.contiguous(), table.shape[0], reads)
            grad_table = grad_table.to(table.dtype)
        return grad_table, None, grad_x


# Eager under torch.compile (a graph break in PEER): unlike the memory read
# (a custom op, memory/fast/ops.py), not yet registered with torch.library.
@torch.compiler.disable
def row_dots(table: torch.Tensor, indices: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(N, dim) table, (B, K) int indices in [0, N), (B, dim) x -> (B, K):
    out[b, k] = table[indices[b, k]] . x[b], differentiable in table and x
    (the table's gradient is dense (N, dim), nonzero only at the rows read)."""
    if table.dim() != 2 or indices.dim() != 2 or x.dim() != 2:
        raise ValueError(f"row_dots takes a (N, dim) table, (B, K) indices and (B, dim) x, got shapes "
                         f"{tuple(table.shape)}, {tuple(indices.shape)}, {tuple(x.shape)}")
    if x.shape != (indices.shape[0], table.shape[1]):
        raise ValueError(f"x must be (B, dim) = ({indices.shape[0]}, {table.shape[1]}), got {tuple(x.shape)}")
    return _RowDots.apply(table, indices, x)
