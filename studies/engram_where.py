"""Where an Engram model keeps a fact asked by question (issue #51): each fact's value scored with every
Engram layer's output kept or zeroed by position.

    python -m memlm.studies.engram_where CHECKPOINT FACTS_JSONL [--n 2000] [--out where.json]

In "Q: What is the {attribute} of {entity}?\\nA: {value}" (memlm.data.facts) the n-grams at the
answer's positions ("A:", then the value's own tokens) are the same for every fact that shares the
value's first tokens, so what Engram adds there cannot tell the facts apart: what it stores must sit
at the question's earlier positions and reach the answer through attention. Each condition scores the
first `--n` facts of FACTS_JSONL as the `bits:` evaluation does (memlm.evals: the value teacher
forced after the question, bits stored = log2 V - its cross-entropy, floored at 0; exact match = every
value token the argmax):

- `all`: Engram as trained;
- `without_entity`: Engram's output zeroed at the entity's tokens;
- `entity_only`: zeroed everywhere but the entity's tokens;
- `after_entity`: zeroed everywhere but after the entity (the question's end, "?\\nA:", and the value's
  tokens, whose n-grams reach back over the entity's last tokens);
- `spanning_ngrams`: zeroed everywhere but the max_order - 1 positions right after the entity, the
  only ones after it whose n-grams hold an entity token;
- `past_spanning`: zeroed everywhere but the positions after those, whose n-grams hold no entity token
  (the same for every fact): what Engram adds there reaches back only through its causal convolution
  (kernel_size taps, dilation apart);
- `none`: zeroed everywhere (the model without Engram).

A fact whose entity does not tokenize the same alone as inside its question is left out (counted).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from memlm.errors import ConfigError, entry_point
from memlm.evals.metrics import stored_bits
from memlm.evals.scoring import continuation_row, encode_pair, score_rows

CONDITIONS = ("all", "without_entity", "entity_only", "after_entity", "spanning_ngrams", "past_spanning", "none")


def entity_span(tokenizer, question: str, entity: str) -> tuple[int, int] | None:
    """The entity's token positions [start, end) in the question's scoring row (an EOS first, then the
    question's tokens), or None where the entity's tokens are not the same alone as in the question."""
    at = question.index(entity)
    whole = tokenizer.encode(question)
    before, through = tokenizer.encode(question[:at].rstrip(" ")), tokenizer.encode(question[:at + len(entity)])
    if whole[:len(before)] != before or whole[:len(through)] != through or len(through) <= len(before):
        return None
    return 1 + len(before), 1 + len(through)


def _keep(condition: str, width: int, span: tuple[int, int], max_order: int) -> torch.Tensor:
    """(1, width, 1) float: 1 where Engram's output is kept under `condition`."""
    on_entity, after, spanning = torch.zeros(width), torch.zeros(width), torch.zeros(width)
    on_entity[span[0]:span[1]] = 1.0
    after[span[1]:] = 1.0
    spanning[span[1]:span[1] + max_order - 1] = 1.0
    keep = {"all": torch.ones(width), "without_entity": 1.0 - on_entity, "entity_only": on_entity,
            "after_entity": after, "spanning_ngrams": spanning, "past_spanning": after - spanning,
            "none": torch.zeros(width)}[condition]
    return keep.view(1, width, 1)


def where(model, tokenizer, facts: list[dict]) -> dict[str, dict]:
    """{condition: {stored_bits, corpus_bits, exact_match, n, skipped}} over `facts` (facts.jsonl records)."""
    engrams = [b.engram for b in model.layers if b.engram is not None]
    if not engrams:
        raise ConfigError("checkpoint", "a model without Engram layers", "a checkpoint with memory.engram.layers")
    max_order = max(e.hash.max_order for e in engrams)
    keep: list[torch.Tensor] = []
    hooks = [e.register_forward_hook(lambda module, args, out: out * keep[0].to(out.dtype)) for e in engrams]
    totals = {c: {"stored_bits": 0.0, "corpus_bits": 0.0, "exact_match": 0.0, "n": 0} for c in CONDITIONS}
    skipped = 0
    try:
        for fact in facts:
            span = entity_span(tokenizer, fact["question"], fact["entity"])
            if span is None:
                skipped += 1
                continue
            ctx, cont = encode_pair(tokenizer, fact["question"], " " + fact["answer"])
            inputs, targets, _ = continuation_row(ctx, cont, model.args.max_seq_len)
            for condition in CONDITIONS:
                keep[:] = [_keep(condition, len(inputs), span, max_order)]
                ((logprob, greedy),) = score_rows(model, [(inputs, targets)], batch_size=1)
                t = totals[condition]
                t["stored_bits"] += stored_bits(-logprob / math.log(2), fact["values"])
                t["corpus_bits"] += math.log2(fact["values"])
                t["exact_match"] += float(greedy)
                t["n"] += 1
    finally:
        for h in hooks:
            h.remove()
    for t in totals.values():
        t["exact_match"] /= max(t["n"], 1)
        t["skipped"] = skipped
    return totals


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.studies.engram_where", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint (or export) of a model with Engram layers")
    parser.add_argument("facts", help="facts.jsonl of the corpus it was trained on (memlm.data.facts)")
    parser.add_argument("--n", type=int, default=2000, help="the first N facts (default 2000)")
    parser.add_argument("--out", default="", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.n < 1:
        raise ConfigError("--n", args.n, "an integer >= 1")
    from memlm.data.tokenizer import Tokenizer
    from memlm.run.load import load_model

    loaded = load_model(args.checkpoint)
    if loaded.tokenizer_path is None:
        raise ConfigError("checkpoint", args.checkpoint, "a checkpoint whose run folder holds its tokenizer.model")
    with open(args.facts, encoding="utf-8") as f:
        facts = [json.loads(line) for _, line in zip(range(args.n), f)]
    results = where(loaded.model.eval(), Tokenizer(loaded.tokenizer_path), facts)
    print("| Engram's output kept | facts | bits stored | share of the corpus's | exact match |")
    print("|---|---:|---:|---:|---:|")
    for condition, r in results.items():
        share = r["stored_bits"] / max(r["corpus_bits"], 1)
        print(f"| {condition} | {r['n']:,} | {r['stored_bits']:,.0f} | {share:.1%} | {r['exact_match']:.1%} |")
    print(f"{results['all']['skipped']} facts left out (the entity tokenizes otherwise inside the question)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
