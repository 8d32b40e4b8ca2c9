"""Scores of single predictions and their aggregation.

Answer normalization follows the SQuAD / NQ-open evaluation scripts
(lowercase, drop punctuation, drop the articles a/an/the, collapse
whitespace), so numbers are comparable with published open-domain QA results.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals any normalized gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # Both empty counts as a match (SQuAD convention); one empty scores 0.
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """Bag-of-words F1 of the normalized texts, the best over the gold answers."""
    pred = normalize_answer(prediction).split()
    return max((_f1(pred, normalize_answer(g).split()) for g in golds), default=0.0)


def argmax_first(values: Sequence[float]) -> int:
    """Index of the largest value; ties go to the first (as numpy.argmax)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def choice_scores(logprobs: Sequence[float], choices: Sequence[str], answer: int) -> dict[str, float]:
    """acc: the most likely choice is the answer; acc_norm: the same with each
    log-likelihood divided by the choice's length in characters (lm-eval's
    definition), which removes the bias towards short answers."""
    normed = [lp / max(len(c), 1) for lp, c in zip(logprobs, choices)]
    return {"acc": float(argmax_first(logprobs) == answer), "acc_norm": float(argmax_first(normed) == answer)}


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def exact_match_by(records: Sequence[dict], field: str) -> dict[str, dict]:
    """Exact match per value of `field` among the records that have it, e.g.
    per question phrasing: {value: {"exact_match", "n"}}, sorted by value."""
    groups: dict[str, list[float]] = {}
    for r in records:
        if field in r:
            groups.setdefault(r[field], []).append(r["exact_match"])
    return {g: {"exact_match": mean(v), "n": len(v)} for g, v in sorted(groups.items())}


# A phrasing counts as answered when at least half its questions are: per
# phrasing a small model is near all-or-nothing (docs/results.md), so the
# share of such phrasings separates "understands the question" from "stored
# the fact" better than the mean.
ANSWERED_PHRASING = 0.5


def phrasing_summary(by_phrasing: dict[str, dict]) -> dict[str, float]:
    """{"phrasings": how many, "phrasings_em50": the share answered (EM >= 50%)}; {} without phrasings."""
    if not by_phrasing:
        return {}
    answered = sum(g["exact_match"] >= ANSWERED_PHRASING for g in by_phrasing.values())
    return {"phrasings": len(by_phrasing), "phrasings_em50": answered / len(by_phrasing)}


def perplexity_metrics(nll_nats: float, tokens: int, n_bytes: int) -> dict[str, float]:
    """Token perplexity and bits per UTF-8 byte (tokenizer-independent) of summed NLL."""
    return {
        "token_ppl": math.exp(nll_nats / tokens) if tokens else float("nan"),
        "bits_per_byte": nll_nats / math.log(2) / n_bytes if n_bytes else float("nan"),
    }


def stored_bits(ce_bits: float, values: int) -> float:
    """Bits of one random fact a model has stored: its entropy log2(values) (the
    value is uniform over `values` candidates) less the model's cross-entropy of
    the value given the question, floored at 0 (Allen-Zhu & Li, "Physics of
    Language Models: Part 3.3", 2024). A model that knows only the candidate set
    scores 0; one that is certain of the right value scores log2(values). Mass
    the model puts outside the candidates only lowers it: a lower bound."""
    return max(0.0, math.log2(values) - ce_bits)


def bits_per_param(stored: float, model) -> dict[str, float]:
    """Stored bits per parameter: all parameters and the ones a token uses."""
    counts = model.num_params()
    return {"params": counts["total"], "active_params": counts["active"],
            "bits_per_param": stored / counts["total"], "bits_per_active_param": stored / counts["active"]}
