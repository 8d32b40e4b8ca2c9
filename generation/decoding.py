"""Batched decoding with the KV cache: greedy for the evals, any token choice
(`pick`) for sampling (memlm.generation.sampling, `python -m memlm.generate`).

    out = decode(model, [prompt_ids(tokenizer, "Q: ...\\nA:")], max_new_tokens=32, eos_id=tokenizer.eos_id)
    texts, out = decode_texts(model, tokenizer, ["Q: ...\\nA:"], stop=["\\n"], max_new_tokens=32)

The model takes no attention mask, so prompts of different lengths cannot
share a batch through padding. Instead prompts are grouped by token length:
rows of one batch sit at the same positions, the prompt is run once through
the model (filling the cache), then each step feeds one token per row. The
result equals decoding each prompt alone without a cache, token for token
(up to float rounding between differently shaped matmuls), which
tests/unit/test_evals_decoding.py checks.

Every prompt starts with the eos token: in packed training data each document
follows an eos, so that is what the model has seen before a fresh text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from memlm.errors import ConfigError


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def prompt_ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.eos_id, *tokenizer.encode(text)]


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped by equal length (longest first), each group cut into batches."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    batches = []
    for n in sorted(groups, reverse=True):
        idx = groups[n]
        batches += [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    return batches


def fit_prompt(tokens: list[int], room: int) -> tuple[list[int], bool]:
    """Keep the last `room` tokens (the question sits at the end; early shots go first)."""
    return (tokens[-room:], True) if len(tokens) > room else (tokens, False)


def argmax_pick(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Greedy choice: logits (batch, vocab) -> (batch,); ties go to the lowest id."""
    return logits.argmax(-1)


def _last(rows: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: the last position of each row, where the next token is read."""
    at = torch.zeros_like(rows, dtype=torch.bool)
    at[:, -1] = True
    return at


# Why a row stopped: the model's eos, the caller's stop check, or max_new_tokens.
FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class Decoded:
    tokens: list[list[int]]  # new tokens per prompt, without the eos
    truncated: list[bool]  # whether each prompt was left-truncated to fit model.max_seq_len
    finish: list[str]  # one of FINISH_REASONS per prompt


@torch.no_grad()
def decode(
    model,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_id: int,
    should_stop: Callable[[list[int]], bool] | None = None,
    batch_size: int = 16,
    use_cache: bool = True,
    on_batch: Callable[[int], None] | None = None,
    pick: Callable[[torch.Tensor, list[int]], torch.Tensor] = argmax_pick,
    lock=None,
) -> Decoded:
    """Continuations of token prompts, one new token per row and step chosen by
    `pick(last logits (batch, vocab), prompt indices of the rows) -> (batch,)`:
    argmax (greedy) by default, a sampler from memlm.generation.sampling otherwise.

    A row stops at eos, when `should_stop(its tokens)` is true, or after
    max_new_tokens. use_cache=False recomputes the whole sequence every step
    (the reference the cache is checked and benchmarked against).

    `lock`: None for a model this process holds whole; the harness, whose
    ranks decode different prompts of one sharded model, passes its
    memlm.evals.lockstep.Lockstep (rounds, all, idle) so that every rank runs
    as many forwards as the busiest one."""
    max_len = model.args.max_seq_len
    room = max_len - max_new_tokens
    if room < 1:
        raise ConfigError("eval.max_new_tokens", max_new_tokens, f"an integer below model.max_seq_len={max_len}")
    fitted = [fit_prompt(list(p), room) for p in prompts]
    if any(not p for p, _ in fitted):
        raise ValueError("decode: empty prompt (every prompt needs at least one token)")
    device = model_device(model)
    outputs: list[list[int]] = [[] for _ in prompts]
    finish = ["length"] * len(prompts)
    batches = length_batches([len(p) for p, _ in fitted], batch_size)
    # On a sharded model every rank runs as many forwards as the busiest one
    # (the caller's lock): a rank past its last batch runs idle forwards.
    for i in range(lock.rounds(len(batches)) if lock else len(batches)):
        batch = batches[i] if i < len(batches) else []
        if batch:
            rows = torch.tensor([fitted[j][0] for j in batch], device=device)  # (batch, prompt_len)
            cache = model.new_cache(len(batch), rows.shape[1] + max_new_tokens) if use_cache else None
            logits = model(rows, cache=cache, at=_last(rows))  # (batch, vocab): the head at the last position only
        else:
            lock.idle(model)
        done = [False] * len(batch)
        for step in range(max_new_tokens):
            if batch:
                nxt = pick(logits, batch)  # (batch,)
                for r, token in enumerate(nxt.tolist()):
                    if done[r]:
                        continue
                    if token == eos_id:
                        done[r], finish[batch[r]] = True, "eos"
                        continue
                    out = outputs[batch[r]]
                    out.append(token)
                    if should_stop is not None and should_stop(out):
                        done[r], finish[batch[r]] = True, "stop"
            if (lock.all(all(done)) if lock else all(done)) or step == max_new_tokens - 1:
                break
            if not batch:
                lock.idle(model)
            elif use_cache:
                logits = model(nxt[:, None], cache=cache)[:, -1]
            else:
                rows = torch.cat([rows, nxt[:, None]], dim=1)
                logits = model(rows, at=_last(rows))
        if on_batch is not None and batch:
            on_batch(len(batch))
    return Decoded(outputs, [t for _, t in fitted], finish)


def greedy_generate(
    model,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_id: int,
    should_stop: Callable[[list[int]], bool] | None = None,
    batch_size: int = 16,
    use_cache: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[list[int]], list[bool]]:
    """Greedy continuations of token prompts: (new tokens per prompt without the
    eos, whether each prompt was left-truncated to fit model.max_seq_len)."""
    out = decode(model, prompts, max_new_tokens, eos_id, should_stop, batch_size, use_cache, on_batch)
    return out.tokens, out.truncated


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the earliest stop sequence."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def decode_texts(
    model,
    tokenizer,
    contexts: Sequence[str],
    stop: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
    pick: Callable[[torch.Tensor, list[int]], torch.Tensor] = argmax_pick,
    use_cache: bool = True,
    lock=None,
) -> tuple[list[str], Decoded]:
    """Continuations of text prompts (each started the evals' way, `prompt_ids`),
    decoded and cut before their first stop sequence: (texts, the token-level
    result). The one text path of the harness, the lm-eval adapter and
    `python -m memlm.generate`."""
    stop = list(stop)

    def should_stop(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens)
        return any(s in text for s in stop)

    prompts = [prompt_ids(tokenizer, c) for c in contexts]
    out = decode(model, prompts, max_new_tokens, tokenizer.eos_id, should_stop if stop else None, batch_size,
                 use_cache, on_batch, pick, lock)
    return [cut_at_stop(tokenizer.decode(o), stop) for o in out.tokens], out


def generate_texts(
    model,
    tokenizer,
    contexts: Sequence[str],
    stop: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
    lock=None,
) -> tuple[list[str], list[bool]]:
    """Greedy continuations of text prompts, each cut before its first stop
    sequence: (texts, whether each prompt was truncated). Shared by the harness and the lm-eval adapter."""
    texts, out = decode_texts(model, tokenizer, contexts, stop, max_new_tokens, batch_size, on_batch, lock=lock)
    return texts, out.truncated
