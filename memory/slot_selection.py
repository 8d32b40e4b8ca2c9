"""Which value rows a sparse fine-tuning step may change (Lin et al. 2025,
"Continual Learning via Sparse Memory Finetuning"): the slots the batch reads
much more than the background (pretraining data) does.

    scores = slot_scores(batch_counts, background_counts, "kl")   # (N,) float64
    rows = top_slots(scores, batch_counts, t)                     # (<= t,) int64, ascending
    restrict_table_grad_(table, rows)                             # every other row's gradient dropped

Counts are reads per slot: how many of the step's token x head x knn reads
chose each slot (memory/usage.py counts them), summed over the layers that
read one table.

The background is a read distribution, not a document frequency. Lin et al.
rank by TF-IDF with each pretraining batch as a document; at memlm's scales a
batch reads nearly every slot (97% of a 16K-slot table in one 4K-token
batch), so every slot has the same document frequency and the ranking would
be arbitrary. Here the document is one read: the background probability of a
slot is its share of the background's reads, with one read added to every
slot (so a slot the background never read has a finite, largest IDF):

    p_bg(i) = (b_i + 1) / (sum(b) + N)
    tfidf:  score_i = c_i * log(1 / p_bg(i))          (term frequency x inverse frequency)
    kl:     score_i = q_i * log(q_i / p_bg(i)),  q_i = c_i / sum(c)
            (slot i's term of KL(batch reads || background reads))

Lin et al.'s own ranking is there too, for batches that read a small share of
the table (their regime: t ~ 500 of 1M slots): the document is one
background batch, and the background is how many of its B batches read each
slot (d_i; memlm.finetune.background records it beside the reads):

    tfidf_batches:  score_i = q_i * log(B / (1 + d_i))

    scores = slot_scores(batch_counts, batches_read, "tfidf_batches", n_batches=B)

Only slots the batch read are candidates (a slot not read has no gradient to
keep). Ties are broken by the lower slot index, so every rank that holds the
same counts selects the same rows.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from memlm.memory.sharded_rows import local_rows
from memlm.memory.sparse_adamw import set_local_sparse_grad, sparse_rows, table_grad

RANKINGS = ("tfidf", "kl", "tfidf_batches")
# The rankings whose background is the number of background batches that read each slot (and how many
# batches there were), not the background's reads.
BY_BATCHES = ("tfidf_batches",)


def background_probability(background: torch.Tensor) -> torch.Tensor:
    """(N,) read counts -> (N,) float64 probabilities with one read added to every slot."""
    b = background.double()
    return (b + 1.0) / (b.sum() + b.numel())


def slot_scores(batch: torch.Tensor, background: torch.Tensor, ranking: str, n_batches: int = 0) -> torch.Tensor:
    """(N,) batch read counts, (N,) background counts -> (N,) float64 scores; slots the batch did not
    read score -inf. The background is its reads per slot, or for a ranking of BY_BATCHES the number of
    its `n_batches` batches that read each slot."""
    if ranking not in RANKINGS:
        raise ValueError(f"ranking {ranking!r}: expected one of {', '.join(RANKINGS)}")
    if batch.shape != background.shape:
        raise ValueError(f"batch counts {tuple(batch.shape)} and background counts {tuple(background.shape)} differ")
    c = batch.double()
    q = c / c.sum().clamp_min(1.0)
    if ranking in BY_BATCHES:
        if n_batches < 1:
            raise ValueError(f"n_batches={n_batches}: ranking {ranking!r} needs the background's batch count (>= 1)")
        score = q * (math.log(n_batches) - (background.to(c.device).double() + 1.0).log())
    elif ranking == "tfidf":
        score = c * -background_probability(background.to(c.device)).log()
    else:
        log_inv_p = -background_probability(background.to(c.device)).log()
        score = q * (q.clamp_min(1e-300).log() + log_inv_p)
    return torch.where(c > 0, score, torch.full_like(score, float("-inf")))


def top_slots(scores: torch.Tensor, batch: torch.Tensor, t: int) -> torch.Tensor:
    """The (at most) `t` best-scoring slots the batch read, ascending int64.

    One host read: how many slots the batch read (the selection's size)."""
    order = torch.sort(-scores, stable=True).indices  # best first; ties: lower slot first
    rows = order[: min(t, int((batch > 0).sum()))]
    return rows.sort().values


@torch.no_grad()
def restrict_table_grad_(table: torch.Tensor, rows: torch.Tensor) -> None:
    """Keep only `rows` (ascending, distinct) of `table`'s gradient, as a
    sparse COO gradient of its local rows: a plain table's `.grad`, a
    column-sharded table's gradient kept beside it (memory/sparse_adamw.py).
    An optimizer that updates rows (SparseRowAdamW, SparseRowSGD) then
    touches those rows alone: their moments, their weight decay."""
    grad = table_grad(table)
    if grad is None:
        return
    rows = local_rows(table, rows)  # a table sharded by rows holds some of them, at its own offsets
    if grad.is_sparse:
        held, values = sparse_rows(grad)
        keep = torch.isin(held, rows)
        indices, values, shape = held[keep], values[keep], grad.shape
    else:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        indices, values, shape = rows, local.index_select(0, rows), local.shape
    kept = torch.sparse_coo_tensor(indices.unsqueeze(0), values, shape, is_coalesced=True, check_invariants=False)
    if isinstance(table, DTensor):
        table.grad = None  # a DTensor cannot hold a sparse gradient: the shard's rows go beside it
        set_local_sparse_grad(table, kept)
    else:
        set_local_sparse_grad(table, None)
        table.grad = kept
