"""The Memory / Memory+ math in plain PyTorch, written the long way: the oracle.

    out = reference_forward(layer, x)   # a Memory / MemoryPlus layer, x (..., dim) -> (..., dim)

or step by step (T tokens, H heads, n = n_keys, N = n**2 slots, K = knn):

    q = query(x, layer.lookup)                  # (T, H, 2, half)   W_q x + b, split in two halves
    k = sub_keys(layer.lookup)                  # (H, 2, n, half)   the two sub-key tables
    if qk_norm: q, k = rms(q) / sqrt(half), rms(k)
    s = all_slot_scores(q, k)                   # (T, H, N)         slot i*n + j scores q1.k1_i + q2.k2_j
    scores, slots = s.topk(K)                   # (T, H, K)         top-K over all N slots
    w = softmax(scores)                         # (T, H, K)         per head
    y = sum_{h,k} w[t,h,k] * V[slots[t,h,k]]    # (T, v_dim)        read(...)
    Memory:  out = y, or W_o y (v_dim != dim)
    Memory+: out = W2(y * silu(W1 x))           gate "swilu"; "sigmoid": sigmoid(W1 x); "none": W2 y

Every one of the N slots is scored with its full key [k1_i ; k2_j]: no
product-key shortcut, no custom op, no kernel, no precision handling (call it
in float64 for a strict oracle; it is O(N) per token, for small tables). The
fast paths (memory/fast/: the exact sqrt(N) search, its sparse backward, the
embedding-bag kernels) and the Hugging Face remote layer
(hf/remote/modeling_memlm.py) are tested against it
(tests/unit/test_memory_reference.py, tests/unit/test_memory_layers.py).

`reference_forward` reads a layer by its attribute names (lookup.query,
lookup.keys, values.weight, w1, w2, out, gate), which memlm's layers and the
remote layer share, so one oracle checks both.
"""

from __future__ import annotations

import torch
from torch import nn


def rms(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x**2) + eps) over the last dim (eps: the dtype's, as F.rms_norm)."""
    eps = torch.finfo(x.dtype).eps
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def query(x: torch.Tensor, lookup: nn.Module) -> torch.Tensor:
    """x (T, dim) -> the query (T, H, 2, half): W_q x + b, each head's k_dim split in halves."""
    q = x @ lookup.query.weight.t() + lookup.query.bias  # (T, H * k_dim)
    return q.view(x.shape[0], lookup.heads, 2, lookup.half)


def all_slot_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q (T, H, 2, half), keys (H, 2, n, half) -> (T, H, n**2): slot i*n + j has the full
    key [k1_i ; k2_j] and scores q . key = q1 . k1_i + q2 . k2_j."""
    heads, _, n, half = keys.shape
    full_keys = torch.cat([keys[:, 0].repeat_interleave(n, dim=1),  # (H, n**2, half): k1_i, i = slot // n
                           keys[:, 1].repeat(1, n, 1)], dim=-1)     # (H, n**2, half): k2_j, j = slot % n
    return torch.einsum("thd,hnd->thn", q.flatten(2), full_keys)    # (T, H, n**2)


def search(q: torch.Tensor, keys: torch.Tensor, knn: int, qk_norm: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> weights (T, H, knn) softmax per head, slots (T, H, knn): the top-knn of all slots."""
    if qk_norm:  # scores = sqrt(half) * cosine of each half with its sub-key
        q, keys = rms(q) * q.shape[-1] ** -0.5, rms(keys)
    scores, slots = all_slot_scores(q, keys).topk(knn, dim=-1)
    return scores.softmax(dim=-1), slots


def read(table: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """table (N, v_dim), slots and weights (T, H, knn) -> y (T, v_dim): the weighted sum of
    the H*knn rows each token reads (an explicit gather, no embedding bag)."""
    rows = table[slots]  # (T, H, knn, v_dim)
    return (weights.unsqueeze(-1).to(rows.dtype) * rows).sum(dim=(1, 2))


def gate(y: torch.Tensor, x: torch.Tensor, w1: nn.Module | None, kind: str) -> torch.Tensor:
    """Memory+'s gate on the read y (T, v_dim): y * silu(W1 x), y * sigmoid(W1 x), or y."""
    if kind == "swilu":
        h = x @ w1.weight.t()
        return y * h * torch.sigmoid(h)  # silu(h) = h * sigmoid(h)
    if kind == "sigmoid":
        return y * torch.sigmoid(x @ w1.weight.t())
    if kind == "none":
        return y
    raise ValueError(f"gate {kind!r}: one of swilu, sigmoid, none")


def reference_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's output by the plain math above, from its own parameters and mode
    (knn in training, eval_knn in eval). x (..., dim) -> (..., dim)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (T, dim)
    lookup = layer.lookup
    knn = lookup.knn if layer.training else lookup.eval_knn
    weights, slots = search(query(x, lookup), lookup.keys, int(knn), lookup.qk_norm)
    y = read(layer.values.weight, slots, weights).to(x.dtype)  # (T, v_dim)
    w2 = getattr(layer, "w2", None)
    if w2 is not None:  # Memory+
        out = gate(y, x, getattr(layer, "w1", None), layer.gate) @ w2.weight.t()
    else:  # Memory
        proj = getattr(layer, "out", None)
        out = y @ proj.weight.t() if proj is not None else y
    return out.reshape(shape)
