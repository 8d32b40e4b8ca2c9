"""Log-likelihood scoring: continuations (multiple choice) and rolling windows (perplexity).

A scoring row is (input tokens, targets): the targets are predicted at the
last len(targets) input positions. Rows are batched by right-padding, which
is exact for a causal model (no real position attends to a pad). Rows with
identical inputs run once: the four single-token letters of an MMLU question
share one forward pass. The output head is applied only at the scored
positions (the model's `at`): over every position it would be most of the
work and memory (16 rows x 300 positions x 32K vocab is 600 MB of logits for
64 useful rows). tests/unit/test_evals_decoding.py checks that the scores equal
those from the full logits. On a sharded model the ranks' batch counts are
matched (memlm.evals.lockstep).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from memlm.evals.lockstep import Lockstep
from memlm.generation.decoding import model_device


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (eos + context, continuation), split as lm-eval does: trailing
    spaces of the context move to the continuation, the pair is encoded as one
    text, and the continuation is what follows the context's own tokens."""
    if not continuation:
        raise ValueError(f"encode_pair: empty continuation for context {context[-40:]!r}")
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    # A merge across the boundary would shift the split: then encode the parts apart.
    cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else tokenizer.encode(continuation)
    return [tokenizer.eos_id, *ctx], cont


def continuation_row(ctx: list[int], cont: list[int], max_len: int) -> tuple[list[int], list[int], bool]:
    """(inputs, targets, truncated): the inputs keep the last max_len tokens."""
    if len(cont) > max_len:
        raise ValueError(f"continuation of {len(cont)} tokens is longer than model.max_seq_len={max_len}")
    full = ctx + cont
    inputs = full[:-1]
    return inputs[-max_len:], cont, len(inputs) > max_len


def rolling_rows(tokens: list[int], prefix_id: int, max_len: int, stride: int = 0) -> list[tuple[list[int], list[int]]]:
    """Windows that predict every token of a document exactly once.

    The first window starts from the prefix token; each next window moves by
    `stride` (default max_len: non-overlapping windows) and scores only the
    tokens not scored before, so with stride < max_len every scored token has at
    least max_len - stride tokens of context."""
    stride = stride or max_len
    full = [prefix_id, *tokens]
    n = len(tokens)  # predictions: full[1:], from inputs full[:-1]
    rows, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + max_len, n)
        rows.append((full[begin:end], full[prev_end + 1:end + 1]))
        prev_end = end
        if end == n:
            break
    return rows


@torch.no_grad()
def score_rows(
    model,
    rows: Sequence[tuple[list[int], list[int]]],
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """(sum of target log-probs, every target is the argmax) per row."""
    device = model_device(model)
    unique: dict[tuple[int, ...], list[int]] = {}
    for r, (inputs, targets) in enumerate(rows):
        if not targets or len(targets) > len(inputs):
            raise ValueError(f"score_rows: row {r} has {len(targets)} targets for {len(inputs)} inputs")
        unique.setdefault(tuple(inputs), []).append(r)
    keys = sorted(unique, key=len, reverse=True)  # similar lengths together: less padding
    results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    starts = range(0, len(keys), batch_size)
    lock = Lockstep.of(model)
    for i in range(lock.rounds(len(starts))):
        if i >= len(starts):
            lock.idle(model)
            continue
        batch = keys[starts[i]:starts[i] + batch_size]
        width = len(batch[0])
        tokens = torch.zeros(len(batch), width, dtype=torch.long, device=device)  # right padding
        scored = torch.zeros(len(batch), width, dtype=torch.bool, device=device)  # positions that predict a target
        for b, key in enumerate(batch):
            tokens[b, :len(key)] = torch.tensor(key, device=device)
            longest = max(len(rows[r][1]) for r in unique[key])
            scored[b, len(key) - longest:len(key)] = True
        logits = model(tokens, at=scored)  # (scored positions, vocab), row-major
        where = (scored.flatten().cumsum(0) - 1).view(len(batch), width)  # (batch, width): row of `logits`
        for b, key in enumerate(batch):
            for r in unique[key]:
                targets = torch.tensor(rows[r][1], device=device)
                positions = where[b, len(key) - len(targets):len(key)]
                logprobs = torch.log_softmax(logits[positions].float(), dim=-1)  # (n_targets, vocab)
                total = logprobs.gather(-1, targets[:, None]).sum().item()
                greedy = bool((logprobs.argmax(-1) == targets).all())
                results[r] = (total, greedy)
        if on_batch is not None:
            on_batch(sum(len(unique[k]) for k in batch))
    return results


def loglikelihoods(
    model,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[tuple[float, bool]], list[bool]]:
    """(log P(continuation | context), greedy) per (context, continuation) text
    pair, and whether each context was left-truncated to fit model.max_seq_len."""
    max_len = model.args.max_seq_len
    rows, truncated = [], []
    for context, continuation in pairs:
        inputs, targets, cut = continuation_row(*encode_pair(tokenizer, context, continuation), max_len)
        rows.append((inputs, targets))
        truncated.append(cut)
    return score_rows(model, rows, batch_size, on_batch), truncated


def rolling_loglikelihoods(
    model,
    tokenizer,
    texts: Sequence[str],
    stride: int = 0,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
    on_windows: Callable[[int], None] | None = None,
) -> list[tuple[float, int]]:
    """(log-likelihood in nats, token count) of each whole text, from rolling
    windows. `on_windows(n)` learns the window count once the texts are
    tokenized (a progress bar's total); `on_batch(k)` then counts k scored windows."""
    max_len = model.args.max_seq_len
    rows, owner, counts = [], [], []
    for d, text in enumerate(texts):
        tokens = tokenizer.encode(text)
        counts.append(len(tokens))
        for row in rolling_rows(tokens, tokenizer.eos_id, max_len, stride):
            rows.append(row)
            owner.append(d)
    if on_windows is not None:
        on_windows(len(rows))
    totals = [0.0] * len(texts)
    for d, (logprob, _) in zip(owner, score_rows(model, rows, batch_size, on_batch)):
        totals[d] += logprob
    return list(zip(totals, counts))
