"""Answer normalization, exact match, token F1 and the aggregations, on hand-made cases."""

from __future__ import annotations

import math

import pytest

from memlm.evals.harness import AGGREGATORS
from memlm.evals.metrics import (
    argmax_first,
    choice_scores,
    exact_match,
    exact_match_by,
    normalize_answer,
    perplexity_metrics,
    phrasing_summary,
    token_f1,
)
from memlm.evals.report import markdown_table


@pytest.mark.parametrize("text, expected", [
    ("The Eiffel Tower", "eiffel tower"),
    ("  an   apple, a PEAR!  ", "apple pear"),
    ("Théâtre d'Orsay.", "théâtre dorsay"),
    ("anthem of the theater", "anthem of theater"),  # articles only as whole words
    ("A", ""),
    ("U.S.A.", "usa"),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_any_gold_after_normalization():
    assert exact_match("the Beatles.", ["Beatles"]) == 1.0
    assert exact_match("paris", ["London", "Paris, France", "PARIS"]) == 1.0
    assert exact_match("Paris France", ["Paris, France"]) == 1.0
    assert exact_match("Paris is the capital", ["Paris"]) == 0.0
    assert exact_match("", ["Paris"]) == 0.0


def test_token_f1_partial_overlap_and_best_gold():
    # prediction tokens: eiffel tower in paris (4), gold: eiffel tower (2): P=2/4, R=1 -> F1=2/3
    assert token_f1("The Eiffel Tower in Paris", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    # the best gold counts: "tower" alone gives P=1/4, R=1 -> 0.4; the other gold gives 2/3
    assert token_f1("The Eiffel Tower in Paris", ["tower", "eiffel tower"]) == pytest.approx(2 / 3)
    # words count with multiplicity: "new new york" shares one "new" and "york" with "new york": P=2/3, R=1
    assert token_f1("new new york", ["new york"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert token_f1("London", ["Paris"]) == 0.0
    assert token_f1("the", ["a"]) == 1.0  # both normalize to empty: SQuAD counts a match
    assert token_f1("the", ["Paris"]) == 0.0


def test_choice_scores_length_normalization_changes_the_choice():
    # The long answer has the lower total log-likelihood but the higher one per character.
    logprobs = [-4.0, -6.0]
    choices = ["ab", "abcdefghijkl"]
    assert choice_scores(logprobs, choices, 0) == {"acc": 1.0, "acc_norm": 0.0}
    assert choice_scores(logprobs, choices, 1) == {"acc": 0.0, "acc_norm": 1.0}
    assert argmax_first([1.0, 3.0, 3.0]) == 1  # ties: the first, as numpy.argmax


def test_mmlu_micro_and_macro_averages_and_subjects():
    records = [{"subject": "algebra", "acc": a, "truncated": 0} for a in (1.0, 1.0, 1.0, 0.0)]
    records += [{"subject": "biology", "acc": 0.0, "truncated": 1}]
    out = AGGREGATORS["mmlu"]("mmlu", records)
    assert out["mmlu"]["acc"] == pytest.approx(3 / 5)  # micro: every question once
    assert out["mmlu"]["acc_macro"] == pytest.approx((0.75 + 0.0) / 2)
    assert out["mmlu"]["n"] == 5 and out["mmlu"]["truncated"] == 1
    assert out["mmlu/algebra"] == {"acc": 0.75, "n": 4}
    assert out["mmlu/biology"] == {"acc": 0.0, "n": 1}


def test_qa_and_ppl_aggregation():
    qa = AGGREGATORS["qa"]("nq_open", [{"exact_match": 1.0, "f1": 1.0, "truncated": 0},
                                       {"exact_match": 0.0, "f1": 0.5, "truncated": 0}])
    assert qa["nq_open"] == {"exact_match": 0.5, "f1": 0.75, "n": 2, "truncated": 0}
    ppl = AGGREGATORS["ppl"]("ppl", [{"nll": 10.0, "tokens": 4, "bytes": 8}, {"nll": 2.0, "tokens": 1, "bytes": 4}])
    assert ppl["ppl"]["token_ppl"] == pytest.approx(math.exp(12.0 / 5))
    assert ppl["ppl"]["bits_per_byte"] == pytest.approx(12.0 / math.log(2) / 12)
    assert (ppl["ppl"]["n"], ppl["ppl"]["tokens"], ppl["ppl"]["bytes"]) == (2, 5, 12)
    assert math.isnan(perplexity_metrics(0.0, 0, 0)["bits_per_byte"])


def test_qa_exact_match_per_phrasing():
    # Phrasing a: 2 of 3 answered (>= 50%), b: 1 of 2 (exactly 50% counts), c: 0 of 1.
    records = [{"exact_match": em, "f1": em, "truncated": 0, "phrasing": p}
               for p, em in [("a", 1.0), ("a", 1.0), ("a", 0.0), ("b", 1.0), ("b", 0.0), ("c", 0.0)]]
    assert exact_match_by(records, "phrasing") == {
        "a": {"exact_match": pytest.approx(2 / 3), "n": 3}, "b": {"exact_match": 0.5, "n": 2},
        "c": {"exact_match": 0.0, "n": 1}}
    out = AGGREGATORS["qa"]("synthetic_qa", records)["synthetic_qa"]
    assert out["exact_match"] == pytest.approx(3 / 6) and out["phrasings"] == 3
    assert out["phrasings_em50"] == pytest.approx(2 / 3)
    assert phrasing_summary({}) == {}  # questions without a template: no breakdown
    table = markdown_table({"synthetic_qa": out}, {}, 7, {"synthetic_qa": exact_match_by(records, "phrasing")})
    rows = [line for line in table.splitlines() if line.startswith("| synthetic_qa | ") and line.count("|") == 5]
    assert [r.split(" | ")[1] for r in rows] == ["a", "b", "c"]  # best first
