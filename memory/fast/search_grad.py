"""`product_key_search`: the exact search with a backward through the selected sub-keys only.

Autograd through `product_key_topk(subkey_scores(q, keys), knn)` back-propagates
through top-k into a zero-filled (T, H, 2, n_keys) gradient and then through
the scoring einsum: two matmuls as large as the forward scoring (at n_keys
1024, k_dim 512 that is ~17 GFLOP per 2048 tokens, as much as a dense FFN).
But only the knn selected scores per (token, head) carry gradient, and a
selected score s1[i] + s2[j] is linear in the query and in the two sub-keys
i and j. With g the gradient of a (token, head)'s selected scores and G[i]
the sum of g over the selected slots whose half c is sub-key i:

    dq_c       = sum_i G[i] * keys_c[i]          a weighted bag of sub-key rows
    dkeys_c[i] = sum over (token, head) of G[i] * q_c    the bag's table gradient

i.e. one embedding bag and its by-slot table gradient (memlm.memory.fast.ops):
T*H*2 bags of ~12 distinct sub-keys each (knn 32: the winners share their
best sub-keys) instead of matmuls over all n_keys. When n_keys is small next
to knn the dense form is cheaper (matmuls beat gathers per flop) and is used
there. Both are exact: tests/unit/test_memory_search.py compares them with
autograd's gradient in float64.

The forward builds no graph over the (T, H, 2, n_keys) scores, and for long
score tensors runs in chunks of tokens (see _search).

The forward scores with TF32 off (memlm.memory.fast.exact.no_tf32: a TF32
operand changes the selected set of ~3% of the lookups at n_keys 1024, k_dim
512, knn 32); the backward runs at the caller's matmul precision.

Forward and backward are torch.library custom ops (`memlm::product_key_search`,
`memlm::product_key_search_backward`, and `memlm::product_key_ranks` for
sub-key scores that keep their own gradient): torch.compile treats each as
one opaque call with a fake kernel for its output shapes (symbolic in knn),
so a memory layer compiles without a graph break; eager numbers are the
kernels' own, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memlm.memory.fast.exact import no_tf32
from memlm.memory.fast.ops import dense_gradient, sort_reads
from memlm.memory.fast.search import slots_of, subkey_scores, topk_with_ranks

# Below n_keys = SPARSE_BACKWARD_RATIO * knn the dense backward (scatter into
# (T, H, 2, n_keys) + two matmuls) is used: its work grows with n_keys, the
# sparse one's with knn, and at small tables the dense one's matmuls are as
# fast or faster. bench/search_backward.py measures both (docs/benchmarks.md).
SPARSE_BACKWARD_RATIO = 8
# Score tensors larger than this are searched in chunks of tokens (see _search).
CHUNK_BYTES = 16 << 20


def _search(query, keys, knn, keep_sub, ordered=True):
    """Forward of the search, no graph: scores, the half top-k lists and the
    winners' ranks in them (search.topk_with_ranks), and the sub-key scores
    if `keep_sub` (else None).

    Without keep_sub, long score tensors on CPU are searched in chunks of
    tokens of at most CHUNK_BYTES: top-k then reads scores still in cache, and the
    allocation stays small enough for malloc to reuse its memory instead of
    mapping (and page-faulting) fresh pages every call (1.25x faster at
    n_keys 1024, 2048 tokens x 4 heads, where the whole tensor is 64 MB)."""
    if keep_sub:
        sub = subkey_scores(query, keys)
        return (*topk_with_ranks(sub, knn, ordered), sub)
    per_token = query.shape[1] * 2 * keys.shape[-2] * query.element_size()
    chunk = max(1, CHUNK_BYTES // per_token)
    if chunk >= query.shape[0] or query.device.type != "cpu":  # (accelerators: caching allocators)
        return (*topk_with_ranks(subkey_scores(query, keys), knn, ordered), None)
    parts = [topk_with_ranks(subkey_scores(q, keys), knn, ordered) for q in query.split(chunk)]
    return (*(torch.cat(p) for p in zip(*parts)), None)


@torch.library.custom_op("memlm::product_key_search", mutates_args=())
def _search_op(query: torch.Tensor, keys: torch.Tensor, knn: int, keep_sub: bool,
               ordered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (T, H, knn), slots (T, H, knn), the half top-k lists and the
    winners' ranks in them (T, H, 2, knn) each (saved for the backward), and
    the sub-key scores (T, H, 2, n_keys) if keep_sub, else an empty tensor.
    Contiguous outputs: the fake kernel below says so to the compiler.
    The scores are IEEE float32 (or wider) products: TF32 off (no_tf32)."""
    with no_tf32():
        scores, half_idx, ranks, sub = _search(query, keys, knn, keep_sub, ordered)
    slots = slots_of(half_idx, ranks, keys.shape[-2])
    sub = query.new_empty(0) if sub is None else sub.contiguous()
    return scores.contiguous(), slots.contiguous(), half_idx.contiguous(), ranks.contiguous(), sub


@_search_op.register_fake
def _(query, keys, knn, keep_sub, ordered):
    t, h = query.shape[:2]
    scores = query.new_empty(t, h, knn)
    slots = query.new_empty(t, h, knn, dtype=torch.long)
    half_idx, ranks = (query.new_empty(t, h, 2, knn, dtype=torch.long) for _ in range(2))
    sub = query.new_empty(t, h, 2, keys.shape[-2]) if keep_sub else query.new_empty(0)
    return scores, slots, half_idx, ranks, sub


@torch.library.custom_op("memlm::product_key_search_backward", mutates_args=())
def _search_backward_op(grad_scores: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, half_idx: torch.Tensor,
                        ranks: torch.Tensor, need_q: bool, need_keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the query and the sub-keys through the selected
    sub-keys; one not asked for comes back empty (an op returns tensors)."""
    knn = grad_scores.shape[-1]
    # G: the gradient of each half's sub-score at each rank of its top-k
    # list (a sub-key is half of several winners: summed).
    g = grad_scores.to(query.dtype).unsqueeze(2).expand(*grad_scores.shape[:2], 2, knn)
    rank_grad = torch.zeros_like(half_idx, dtype=query.dtype).scatter_add_(-1, ranks, g)
    if keys.shape[-2] < SPARSE_BACKWARD_RATIO * knn:
        gq, gk = _dense_backward(query, keys, half_idx, rank_grad, need_q, need_keys)
    else:
        used = torch.zeros_like(half_idx, dtype=torch.bool).scatter_(-1, ranks, True)
        gq, gk = _sparse_backward(query, keys, half_idx, rank_grad, used, need_q, need_keys)
    # Contiguous, as the fake kernel promises (the dense backward's einsums may return permuted views).
    return ((query.new_empty(0) if gq is None else gq.contiguous()),
            (keys.new_empty(0) if gk is None else gk.contiguous()))


@_search_backward_op.register_fake
def _(grad_scores, query, keys, half_idx, ranks, need_q, need_keys):
    return (query.new_empty(query.shape) if need_q else query.new_empty(0),
            keys.new_empty(keys.shape) if need_keys else keys.new_empty(0))


def _search_setup_context(ctx, inputs, output):
    query, keys = inputs[:2]
    _, slots, half_idx, ranks, sub = output
    ctx.save_for_backward(query, keys, half_idx, ranks)
    ctx.mark_non_differentiable(slots, half_idx, ranks, sub)
    # Otherwise autograd would hand backward zero-filled gradients of the
    # int outputs and of the (T, H, 2, n_keys) sub-scores (40 ms at n_keys 1024).
    ctx.set_materialize_grads(False)


def _search_backward(ctx, grad_scores, *_unused):  # no gradient for slots, ranks, sub-scores
    query, keys, half_idx, ranks = ctx.saved_tensors
    need_q, need_keys = ctx.needs_input_grad[:2]
    if grad_scores is None or not (need_q or need_keys):  # the scores were not used in the loss
        return None, None, None, None, None
    gq, gk = torch.ops.memlm.product_key_search_backward(grad_scores, query, keys, half_idx, ranks,
                                                          need_q, need_keys)
    return (gq if need_q else None), (gk if need_keys else None), None, None, None


_search_op.register_autograd(_search_backward, setup_context=_search_setup_context)


def _compact_reads(device: torch.device) -> bool:
    """Drop the unused ranks' reads? It takes a nonzero(), a host sync: worth
    it on CPU, where the gathers are the cost, not on an accelerator."""
    return device.type == "cpu"


def _sparse_backward(query, keys, half_idx, rank_grad, used, need_q, need_keys):
    """Gradients through the sub-keys the winners use: one bag per (token,
    head, half) over the ranks in `used` (on CPU only those: ~12 of knn = 32;
    elsewhere all knn, the unused with weight 0, so that no host sync is needed)."""
    t, h, _, knn = half_idx.shape
    n_keys, half = keys.shape[-2:]
    key_heads = 1 if keys.dim() == 3 else h  # one (n_keys, half) block per (key head, half)
    base = (torch.arange(key_heads * 2, device=keys.device) * n_keys).view(1, key_heads, 2, 1)
    rows = (half_idx + base).view(-1)  # into the sub-key table viewed as (key_heads * 2 * n_keys, half)
    weights = rank_grad.view(-1)
    bags = t * h * 2
    if _compact_reads(keys.device):
        keep = used.view(-1).nonzero().squeeze(1)
        rows, weights = rows.index_select(0, keep), weights.index_select(0, keep)
        bag_of_read = torch.div(keep, knn, rounding_mode="floor")
        counts = used.view(bags, knn).sum(1)
        offsets = torch.cumsum(counts, 0) - counts
    else:
        bag_of_read = torch.arange(bags, device=keys.device).repeat_interleave(knn)
        offsets = torch.arange(0, bags * knn, knn, device=keys.device)
    table = keys.reshape(-1, half)
    grad_query = grad_keys = None
    if need_q:
        grad_query = F.embedding_bag(rows, table, offsets, per_sample_weights=weights, mode="sum").view_as(query)
    if need_keys:
        # By-slot accumulation (reads sorted by sub-key, one bag each): no
        # (reads, half) tensor of per-read products, deterministic.
        reads = sort_reads(rows, table.shape[0], bags=bag_of_read)
        grad_keys = dense_gradient(rows, weights, query.reshape(bags, half), table.shape[0], reads)
        grad_keys = grad_keys.view_as(keys)
    return grad_query, grad_keys


def _dense_backward(query, keys, half_idx, rank_grad, need_q, need_keys):
    """The same gradients through a dense (T, H, 2, n_keys) sub-score gradient
    (what autograd computes), cheaper when n_keys is small next to knn."""
    t, h, _, knn = half_idx.shape
    grad_sub = query.new_zeros(t, h, 2, keys.shape[-2]).scatter_(-1, half_idx, rank_grad)  # distinct per row
    shared = keys.dim() == 3
    grad_query = grad_keys = None
    if need_q:
        grad_query = torch.einsum("thcn,cnd->thcd" if shared else "thcn,hcnd->thcd", grad_sub, keys)
    if need_keys:
        grad_keys = torch.einsum("thcn,thcd->cnd" if shared else "thcn,thcd->hcnd", grad_sub, query)
    return grad_query, grad_keys


@torch.library.custom_op("memlm::product_key_ranks", mutates_args=())
def _ranks_op(sub_scores: torch.Tensor, knn: int, ordered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H, 2, n_keys) sub-key scores -> the half top-k lists and the
    winners' ranks in them, (T, H, 2, knn) each (search.topk_with_ranks). No gradient."""
    _, half_idx, ranks = topk_with_ranks(sub_scores, knn, ordered)
    return half_idx.contiguous(), ranks.contiguous()


@_ranks_op.register_fake
def _(sub_scores, knn, ordered):
    t, h = sub_scores.shape[:2]
    return tuple(sub_scores.new_empty(t, h, 2, knn, dtype=torch.long) for _ in range(2))


def topk_of_sub_scores(
    sub_scores: torch.Tensor, knn: int, ordered: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """search.product_key_topk(sub_scores, knn, ordered), the same numbers
    (each winner's score is the same sum s1[i] + s2[j]), for sub-key scores
    that need their gradient (a loss on them): the search runs as one op on
    the detached scores, and the winners' scores are gathered from
    `sub_scores`, so the gradient is autograd's (dense) and torch.compile
    traces it without a graph break. -> scores (T, H, knn), slots (T, H, knn)."""
    half_idx, ranks = torch.ops.memlm.product_key_ranks(sub_scores.detach(), knn, ordered)
    s1, s2 = sub_scores.gather(-1, half_idx.gather(-1, ranks)).unbind(2)  # (T, H, knn) each
    return s1 + s2, slots_of(half_idx, ranks, sub_scores.shape[-1])


def product_key_search(
    query: torch.Tensor, keys: torch.Tensor, knn: int, keep_sub: bool = False, ordered: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Exact top-`knn` slots per token and head, differentiable in the scores.

    query (T, H, 2, half); keys (H, 2, n_keys, half), or (2, n_keys, half)
    shared by the heads (PEER). Returns scores (T, H, knn) (descending if
    `ordered`, else unordered: see product_key_topk), slots (T, H, knn) int64
    (slot = i * n_keys + j), and, if `keep_sub`, the sub-key
    scores (T, H, 2, n_keys) detached, else None (then the search may run in
    chunks of tokens and never hold them all). A loss on the sub-key scores
    needs `subkey_scores` + `product_key_topk`, whose gradient is dense.
    Same results as product_key_topk(subkey_scores(query, keys), knn); the
    gradients w.r.t. query and keys equal autograd's through it.

    One custom op under torch.compile (`memlm::product_key_search`, with
    `memlm::product_key_search_backward`): opaque to the compiler, so a
    memory layer traces without a graph break, and `knn` may be symbolic
    (a knn schedule does not recompile; see ProductKeys)."""
    scores, slots, _, _, sub = torch.ops.memlm.product_key_search(query, keys, knn, keep_sub, ordered)
    return scores, slots, (sub if keep_sub else None)
