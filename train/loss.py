"""The language-modelling loss without an fp32 copy of all the logits.

    loss = chunked_cross_entropy(logits, targets)   # logits (batch, seq, vocab), targets (batch, seq)

Equal to `F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())`
(mean over tokens) within fp32 rounding, in value and gradient. Targets
equal to IGNORE (-100, F.cross_entropy's ignore_index: the padding of
`data.rows=documents`) add nothing, and the mean is over the others. That
reference upcasts every logit at once and autograd keeps the fp32
log-softmax for the backward: at the 8b preset's vocabulary (128,256) and
4,096 tokens that is 2.1 GB of fp32 next to 1.05 GB of bf16 logits, and
more than the whole rest of the step's activations at small models.

Here the tokens are processed in chunks of at most CHUNK_BYTES of fp32
logits: the forward upcasts one chunk, sums its cross-entropy and frees it;
the backward recomputes the chunk's softmax in fp32 from the saved (bf16)
logits and writes that chunk of the gradient in the logits' dtype. Nothing
but the logits and the targets is kept for the backward. The fp32 working set is one chunk: the full
copy divided by the number of chunks (2.1 GB -> 64 MiB: 130 tokens a chunk, 32 chunks, at the 8b
preset's shapes). Pure tensor code with no host read, so it adds no sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memlm.data.config import IGNORE

# fp32 bytes of logits one chunk may hold (forward and backward).
CHUNK_BYTES = 64 << 20


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many fp32 rows of `vocab` logits as fit in `chunk_bytes` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, chunk):
        # logits (N, V) any float dtype; targets (N,) int64 -> mean loss, fp32 scalar
        n = logits.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            rows = logits[start:start + chunk].float()  # (c, V): the only fp32 copy alive
            total += F.cross_entropy(rows, targets[start:start + chunk], reduction="sum", ignore_index=IGNORE)
        valid = targets != IGNORE  # (N,)
        # The tokens trained on, a device count (no host read): N exactly when none is ignored, so the
        # division is the one by N (an integer below 2**24 is exact in float32).
        count = valid.sum().clamp(min=1)  # int64: what the backward keeps is no float copy
        ctx.save_for_backward(logits, targets, valid, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, valid, count = ctx.saved_tensors
        n, chunk = logits.shape[0], ctx.chunk
        grad = torch.empty_like(logits)
        scale = grad_loss.float() / count  # a device scalar: no host read
        for start in range(0, n, chunk):
            # d(mean loss)/dx = (softmax(x) - onehot(t)) / N; the softmax recomputed
            # in fp32 (one fused pass over the chunk's saved logits). An ignored row's
            # factor is 0 (its scatter at class 0 is then multiplied away).
            p = torch.softmax(logits[start:start + chunk], dim=-1, dtype=torch.float32)  # (c, V)
            t = targets[start:start + chunk].clamp(min=0).unsqueeze(1)  # (c, 1)
            p.scatter_add_(1, t, p.new_full(t.shape, -1.0))
            factor = scale * valid[start:start + chunk].unsqueeze(1)  # (c, 1): scale, or 0 where ignored
            grad[start:start + chunk] = p.mul_(factor)
        return grad, None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Mean cross-entropy of `logits` (..., vocab) against `targets` (...),
    computed in fp32 chunk by chunk (see the module docstring). Returns an
    fp32 scalar."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must agree on every "
                         "dimension but the last (vocab)")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    vocab = logits.shape[-1]
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, vocab), targets.reshape(-1), chunk_tokens(vocab, chunk_bytes))
