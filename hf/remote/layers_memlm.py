"""The pieces every memlm layer in transformers reads its tables with (trust_remote_code): torch only.

Copied verbatim into every non-dense export beside modeling_memlm.py, experts_memlm.py and
ultramem_memlm.py, which import from it:

    with full_precision(x.device): ...                 # autocast off: scores and top-k in float32
    scores, slots = product_key_topk(sub_scores, knn)  # (T, H, 2, n) -> the exact top-knn of all n**2 pairs
    y = ValuePool(n_slots, v_dim, dtype).read(slots, weights)  # (T, K) each -> (T, v_dim)
    h = row_dots(table, idx, x)                        # (T, K): table[idx[t, k]] . x[t], memlm's sums

Each restates memlm's own (memory/, model/) in plain PyTorch, summing in memlm's
order, so an export's logits equal memlm's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}

# Read once: torch.compile 2.11 cannot trace torch.amp.is_autocast_available (a graph break per call).
_AUTOCAST_TYPES = frozenset(t for t in ("cpu", "cuda", "xpu", "mps", "hpu") if torch.amp.is_autocast_available(t))


def full_precision(device: torch.device):
    """Autocast off: product-key scores, top-k and softmax run in float32 (as in memlm)."""
    if device.type not in _AUTOCAST_TYPES:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def product_key_topk(sub_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sub_scores (T, H, 2, n_keys) -> the exact top-knn of s1[i] + s2[j] over
    all n_keys**2 pairs: scores (T, H, knn), slots i * n_keys + j (T, H, knn).
    A pair in the overall top-knn has each half in its half's top-knn, so
    the knn x knn candidate sums suffice."""
    n_keys = sub_scores.shape[-1]
    half_scores, half_idx = sub_scores.topk(knn, dim=-1)  # (T, H, 2, knn)
    cand = half_scores[:, :, 0, :, None] + half_scores[:, :, 1, None, :]  # (T, H, knn, knn)
    scores, best = cand.flatten(-2).topk(knn, dim=-1)  # (T, H, knn)
    i = half_idx[:, :, 0].gather(-1, torch.div(best, knn, rounding_mode="floor"))
    j = half_idx[:, :, 1].gather(-1, best % knn)
    return scores, i * n_keys + j


class ValuePool(nn.Module):
    """The (n_slots, v_dim) value table, owned by a layer or shared by all of them."""

    def __init__(self, n_slots: int, v_dim: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.weight = nn.Parameter(torch.zeros(n_slots, v_dim, dtype=dtype))

    def read(self, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """slots, weights (T, K) -> (T, v_dim): sum_k weights * table[slots], in the table's dtype."""
        if self.weight.dtype != self.dtype:
            # model.float() / .to(dtype) cast every tensor; the table's storage
            # dtype (memory.value_dtype) is part of the math, so it is restored once.
            with torch.no_grad():
                self.weight.data = self.weight.data.to(self.dtype)
        aligned(self.weight)
        with full_precision(slots.device):
            return F.embedding_bag(slots, self.weight, per_sample_weights=weights.to(self.weight.dtype), mode="sum")


def _dots(table: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """table (N, dim), idx (T, K), x (T, dim) of table's dtype -> (T, K): table[idx[t, k]] . x[t],
    each dot by the kernel memlm's row_dots takes, so the sums are memlm's bit for bit."""
    tokens, k = idx.shape
    if table.device.type == "cpu":
        # memlm (memory/fast/bag_grad.py weight_gradients): the per-sample-weights backward of
        # embedding_bag, a BLAS dot per read, without gathering (T, K, dim).
        flat = idx.reshape(-1)
        offsets = torch.arange(0, tokens * k, k, dtype=flat.dtype)
        bag = torch.arange(tokens).repeat_interleave(k).to(flat.dtype)
        try:
            return torch.ops.aten._embedding_bag_per_sample_weights_backward(
                x, table, flat, offsets, bag, 0, -1).view(tokens, k)
        except (AttributeError, RuntimeError, TypeError):
            pass
    compute = torch.promote_types(table.dtype, torch.float32)  # memlm's gathered_dots: a batched matmul
    return torch.bmm(table[idx].to(compute), x.to(compute).unsqueeze(-1)).squeeze(-1)


class _RowDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, idx, x):
        ctx.save_for_backward(table, idx, x)
        return _dots(table.detach(), idx, x.detach().to(table.dtype).contiguous())

    @staticmethod
    def backward(ctx, grad):
        table, idx, x = ctx.saved_tensors
        grad_table = grad_x = None
        if ctx.needs_input_grad[2]:
            grad_x = F.embedding_bag(idx, table, per_sample_weights=grad.to(table.dtype), mode="sum").to(x.dtype)
        if ctx.needs_input_grad[0]:
            reads = (grad.unsqueeze(-1) * x.unsqueeze(1).to(grad.dtype)).flatten(0, 1)  # (T*K, dim)
            grad_table = torch.zeros_like(table).index_add_(0, idx.reshape(-1), reads.to(table.dtype))
        return grad_table, None, grad_x


def aligned(table: torch.Tensor) -> torch.Tensor:
    """The table, moved once to memory aligned as torch allocates it (64 bytes on CPU). A
    safetensors file maps tensors at any offset, and the CPU's BLAS dots split their sums by
    the data's alignment: a table read where it was mapped gives other last bits than memlm's."""
    if table.device.type == "cpu" and table.data_ptr() % 64:
        with torch.no_grad():
            table.data = table.data.clone()
    return table


def row_dots(table: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """table (N, dim), idx (T, K), x (T, dim) -> (T, K): table[idx[t, k]] . x[t] (memlm memory/fast/row_dots.py)."""
    return _RowDots.apply(aligned(table), idx, x).to(torch.promote_types(table.dtype, x.dtype))
