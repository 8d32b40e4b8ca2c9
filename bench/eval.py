"""Benchmark: the evaluation harness's two speed-ups, measured in one run (about 1 minute on 2 cores).

    python bench/eval.py            # full run, writes docs/benchmarks.md
    python bench/eval.py --quick    # smaller sizes, a smoke run (writes nothing)

Model: dim 256, 4 layers, 4 heads (2 KV heads), vocab 32,000, random weights
(speed does not depend on what the weights say), fp32 on CPU.
1. Greedy generation of 32 new tokens for 8 prompts of 256 tokens (a 5-shot
   QA prompt): the KV cache (prompt once, then one token per step) against
   recomputing the whole sequence every step; both batched, same prompts. The
   generated tokens are checked to be identical.
2. Multiple-choice scoring, batches of 16 sequences against one per forward
   pass: 48 MMLU-shaped questions (300-token 5-shot context, 4 one-token
   letters: one forward per question after deduplication), and 48 zero-shot
   HellaSwag-shaped ones (40-token context, 4 endings of 16 tokens: 4 rows each).
Writes "## Evaluation (bench/eval.py)" in docs/benchmarks.md (other sections are kept).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from memlm.config.run import compose
from memlm.evals.scoring import score_rows
from memlm.generation.decoding import greedy_generate
from memlm.model import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_line, write_section  # noqa: E402

TITLE = "## Evaluation (bench/eval.py)"
NEW_TOKENS, GOAL = 32, 3.0


def timed(fn, repeats: int) -> tuple[float, object]:
    """Fastest of `repeats` runs (other jobs share the cores), and the last result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes; do not write docs/benchmarks.md")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on shared cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = machine_line()
    cfg = compose(["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
                   "model.vocab_size=32000", "model.max_seq_len=1024", "model.multiple_of=64"])
    model = build_model(cfg.model, seed=0).eval()
    params = model.num_params()["total"]
    gen = torch.Generator().manual_seed(0)
    n_prompts, prompt_len = (4, 64) if args.quick else (8, 256)
    prompts = torch.randint(4, 32000, (n_prompts, prompt_len), generator=gen).tolist()
    repeats = 1 if args.quick else 2

    def generate(use_cache: bool):
        return greedy_generate(model, prompts, NEW_TOKENS, eos_id=-1, batch_size=n_prompts, use_cache=use_cache)[0]

    t_cached, out_cached = timed(lambda: generate(True), repeats)
    t_plain, out_plain = timed(lambda: generate(False), 1)  # the long baseline: one run keeps the bench short
    same = out_cached == out_plain
    print(f"generation: cached {t_cached:.2f}s, uncached {t_plain:.2f}s, identical tokens: {same}", flush=True)

    n_questions, context_len = (12, 96) if args.quick else (48, 300)
    letters = [[330], [331], [332], [333]]  # one-token continuations, as " A" ... " D"
    contexts = torch.randint(4, 32000, (n_questions, context_len), generator=gen).tolist()
    mmlu_rows = [(ctx, letter) for ctx in contexts for letter in letters]
    short_rows = []
    for ctx in torch.randint(4, 32000, (n_questions, 40), generator=gen).tolist():
        for ending in torch.randint(4, 32000, (4, 16), generator=gen).tolist():
            short_rows.append((ctx + ending[:-1], ending))

    scoring = []
    for name, rows in (("mmlu", mmlu_rows), ("short", short_rows)):
        t_batched, s_batched = timed(lambda rows=rows: score_rows(model, rows, 16), repeats)
        t_single, s_single = timed(lambda rows=rows: score_rows(model, rows, 1), repeats)
        diff = max(abs(a[0] - b[0]) for a, b in zip(s_batched, s_single))
        print(f"scoring {name}: batch 16 {t_batched:.2f}s, batch 1 {t_single:.2f}s, max |diff| {diff:.1e}", flush=True)
        scoring.append((t_batched, t_single, diff))
    (t_batched, t_single, close), (short_batched, short_single, short_diff) = scoring
    close = max(close, short_diff)

    gen_speedup, score_speedup = t_plain / t_cached, t_single / t_batched
    short_speedup = short_single / short_batched
    met = "met" if gen_speedup >= GOAL else "not met"
    body = f"""{header} Load average at the end: {os.getloadavg()[0]:.2f}; {args.threads} torch thread(s); the cores are shared with other jobs.

Model: dim 256, 4 layers, 4 heads (2 KV heads), vocab 32,000 ({params / 1e6:.1f}M parameters), random weights, fp32. Each time is the fastest of {repeats} runs, except the no-cache generation (one run).

| work | baseline | memlm | speedup |
|---|---:|---:|---:|
| greedy generation, {n_prompts} prompts x {prompt_len} tokens, {NEW_TOKENS} new tokens | no cache: {t_plain:.2f} s | KV cache: {t_cached:.2f} s | {gen_speedup:.1f}x |
| multiple choice, {n_questions} questions x 4 letters, {context_len}-token contexts (MMLU 5-shot) | 1 sequence / forward: {t_single:.2f} s | 16 / forward: {t_batched:.2f} s | {score_speedup:.2f}x |
| multiple choice, {n_questions} questions x 4 endings of 16 tokens, 40-token contexts (zero-shot) | 1 sequence / forward: {short_single:.2f} s | 16 / forward: {short_batched:.2f} s | {short_speedup:.2f}x |

- KV cache: {gen_speedup:.1f}x faster than recomputing the sequence each step (goal >= {GOAL:.0f}x: {met}); the generated tokens are {"identical" if same else "NOT identical"}. Without the cache step t costs a forward pass over prompt + t tokens (and the output head over all of them); with it, one token.
- Batched scoring: {score_speedup:.2f}x (long contexts) and {short_speedup:.2f}x (short ones) over one sequence per forward pass; log-likelihoods agree within {close:.1e}. The four letters of an MMLU question share one forward pass in both (identical inputs are deduplicated), and the output head runs only at the scored positions in both, so this is the gain of batching alone. On one CPU thread a 300-token sequence already keeps the matmuls busy, so batching gains little there; it pays off more for short sequences (per-call overhead). On a GPU, where one sequence leaves most of the device idle, it should matter more (not measured here).
"""
    print(body)
    if not args.quick:
        write_section(TITLE, body)
        print(f"wrote {TITLE!r} in docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
