"""The Memory / Memory+ and PEER math in plain PyTorch, written the long way: the oracle.

    out = reference_forward(layer, x)   # a Memory / MemoryPlus layer, x (..., dim) -> (..., dim)
    out = peer_forward(peer, x)         # a PEER FFN (model/peer.py),  x (..., dim) -> (..., dim)

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
             with biases (memory.w_bias):       W2(y * silu(W1 x + b1)) + b2

PEER (N = n**2 single-neuron experts: down rows u, up rows v; the heads share the sub-keys):

    q = query(x, peer)                          # (T, H, 2, half)   W_q x (no bias)
    if query_norm: q = rms(q)                   #                   unit-RMS halves; no 1/sqrt(half), keys as they are
    w, experts = search(q, keys for every head, K)  # (T, H, K)     the same all-slot search
    h = act(u_e . x)                            # (T, H, K)         gelu or silu of each kept expert's down dot
    out = sum_{h,k} w * h * v_e                 # (T, dim)          read(up, experts, w * h)

Every one of the N slots is scored with its full key [k1_i ; k2_j]: no
product-key shortcut, no custom op, no kernel, no precision handling (call it
in float64 for a strict oracle; it is O(N) per token, for small tables). The
fast paths (memory/fast/: the exact sqrt(N) search, its sparse backward, the
embedding-bag kernels) and the Hugging Face remote layer
(hf/remote/modeling_memlm.py, experts_memlm.py) are tested against it
(tests/unit/test_memory_reference.py, tests/unit/test_memory_layers.py), and
so are memlm's PEER and the remote one (tests/unit/test_memory_reference.py).

`reference_forward` reads a layer by its attribute names (lookup.query,
lookup.keys, values.weight, w1, w2, out, gate; a Linear's bias where it has
one), which memlm's layers and the
remote layer share, so one oracle checks both; `peer_forward` likewise (query,
keys, experts.down, experts.up, heads, knn, query_norm, activation).
"""

from __future__ import annotations

import torch
from torch import nn


def rms(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x**2) + eps) over the last dim (eps: the dtype's, as F.rms_norm)."""
    eps = torch.finfo(x.dtype).eps
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def affine(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """x (T, in) -> W x + b (T, out) of an nn.Linear, the b only where it has one."""
    out = x @ lin.weight.t()
    return out + lin.bias if lin.bias is not None else out


def query(x: torch.Tensor, lookup: nn.Module) -> torch.Tensor:
    """x (T, dim) -> the query (T, H, 2, half): W_q x + b (PEER: no b), each head's k_dim split in halves."""
    return affine(x, lookup.query).view(x.shape[0], lookup.heads, 2, -1)  # (T, H * k_dim) split


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


def act(h: torch.Tensor, kind: str) -> torch.Tensor:
    """silu(h) = h * sigmoid(h); gelu(h) = h * Phi(h), Phi the standard normal CDF (the exact, erf one)."""
    if kind == "silu":
        return h * torch.sigmoid(h)
    if kind == "gelu":
        return h * 0.5 * (1 + torch.erf(h * 2**-0.5))
    raise ValueError(f"activation {kind!r}: one of silu, gelu")


def gate(y: torch.Tensor, x: torch.Tensor, w1: nn.Module | None, kind: str) -> torch.Tensor:
    """Memory+'s gate on the read y (T, v_dim): y * silu(W1 x [+ b1]), y * sigmoid(W1 x [+ b1]), or y."""
    if kind == "swilu":
        return y * act(affine(x, w1), "silu")
    if kind == "sigmoid":
        return y * torch.sigmoid(affine(x, w1))
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
        out = affine(gate(y, x, getattr(layer, "w1", None), layer.gate), w2)
    else:  # Memory
        proj = getattr(layer, "out", None)
        out = affine(y, proj) if proj is not None else y
    return out.reshape(shape)


def peer_retrieve(x: torch.Tensor, peer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, dim) -> PEER's weights (T, H, knn), softmax per head, and experts (T, H, knn):
    the top-knn of all N experts, scored with the sub-keys every head shares."""
    q = query(x, peer)  # (T, H, 2, half)
    if peer.query_norm:  # PEER's own norm: the query halves only, unscaled (not the memory layers' qk_norm)
        q = rms(q)
    keys = peer.keys.expand(peer.heads, *peer.keys.shape)  # (2, n, half) -> (H, 2, n, half)
    return search(q, keys, peer.knn)


def peer_forward(peer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """PEER's output by the plain math above, from its own parameters. x (..., dim) -> (..., dim)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (T, dim)
    weights, experts = peer_retrieve(x, peer)  # (T, H, knn) each
    down = peer.experts.down[experts]  # (T, H, knn, dim): u of each kept expert
    h = act((down * x[:, None, None, :]).sum(dim=-1), peer.activation)  # (T, H, knn): act(u . x)
    return read(peer.experts.up, experts, weights.to(h.dtype) * h).to(x.dtype).reshape(shape)
