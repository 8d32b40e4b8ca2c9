"""Evaluating one loaded task: per-example records on each rank, gathered, aggregated.

Rank r takes examples r::world_size. Every rank computes one record per
example it owns; the records are gathered (torch.distributed.all_gather_object)
back into dataset order and aggregated the same way as in one process. A
record's log-likelihood may differ from one process's in its last digits: the
rank batches the example with other neighbours (docs/evals.md, "Distributed").
"""

from __future__ import annotations

import math
import sys

import torch.distributed as dist
from tqdm import tqdm

from memlm.config.eval import EvalConfig
from memlm.errors import ConfigError
from memlm.evals import prompts
from memlm.evals.lockstep import Lockstep
from memlm.evals.metrics import (
    bits_per_param,
    choice_scores,
    exact_match,
    exact_match_by,
    mean,
    perplexity_metrics,
    phrasing_summary,
    stored_bits,
    token_f1,
)
from memlm.evals.scoring import loglikelihoods, rolling_loglikelihoods
from memlm.evals.tasks import TaskData
from memlm.generation.decoding import generate_texts


def evaluate_task(model, tokenizer, task: TaskData, cfg: EvalConfig, rank: int = 0, world_size: int = 1,
                  ) -> tuple[dict[str, dict], list[dict]]:
    """({result key: metrics}, per-example records in dataset order). MMLU adds
    one `mmlu/<subject>` key per subject next to `mmlu`."""
    mine = task.examples[rank::world_size]
    kind = task.spec.kind
    with tqdm(total=len(mine), desc=f"[eval] {task.spec.name}", unit="ex", file=sys.stderr,
              disable=rank != 0, dynamic_ncols=True) as bar:
        records = RECORDERS[kind](model, tokenizer, task, mine, cfg, bar)
    records = gather_records(records, world_size)
    metrics = AGGREGATORS[kind](task.spec.name, records)
    if kind == "bits":
        metrics[task.spec.name].update(bits_per_param(metrics[task.spec.name]["stored_bits"], model))
    return metrics, records


def gather_records(records: list[dict], world_size: int) -> list[dict]:
    """All ranks' records in dataset order (rank r held examples r::world_size)."""
    if world_size == 1:
        return records
    parts: list[list[dict]] = [[] for _ in range(world_size)]
    dist.all_gather_object(parts, records)
    merged = []
    for j in range(max(len(p) for p in parts)):
        merged += [p[j] for p in parts if j < len(p)]
    return merged


# ------------------------------------------------------------- per example
def _prompt(context: str, cfg: EvalConfig) -> dict:
    # Prompts are only kept for the samples file: they are most of a record's size.
    return {"prompt": context} if cfg.log_samples else {}


def _phrasing(example: dict) -> dict:
    # Synthetic questions name their template: EM is also reported per phrasing.
    return {"phrasing": example["phrasing"]} if "phrasing" in example else {}


def _qa_records(model, tokenizer, task: TaskData, examples, cfg: EvalConfig, bar: tqdm) -> list[dict]:
    shots = task.shots[""]
    contexts = [prompts.qa_prompt(shots, ex["question"]) for ex in examples]
    texts, cut = generate_texts(model, tokenizer, contexts, cfg.stop, cfg.max_new_tokens, cfg.batch_size, bar.update,
                                lock=Lockstep.of(model))  # the ranks decode different examples
    records = []
    for ex, context, text, truncated in zip(examples, contexts, texts, cut):
        pred = text.strip()
        records.append({"question": ex["question"], "answers": ex["answers"], "prediction": pred,
                        "exact_match": exact_match(pred, ex["answers"]), "f1": token_f1(pred, ex["answers"]),
                        "truncated": int(truncated), **_phrasing(ex), **_prompt(context, cfg)})
    return records


def _choice_records(model, tokenizer, task: TaskData, examples, cfg: EvalConfig, bar: tqdm) -> list[dict]:
    mmlu = task.spec.kind == "mmlu"
    pairs, spans, contexts = [], [], []
    for ex in examples:
        if mmlu:
            context = prompts.mmlu_prompt(task.shots[ex["subject"]], ex)
            conts = prompts.mmlu_continuations()
        else:
            context = prompts.choice_prompt(task.shots[""], ex)
            conts = prompts.choice_continuations(ex)
        spans.append((len(pairs), len(pairs) + len(conts)))
        pairs += [(context, c) for c in conts]
        contexts.append(context)
    bar.reset(total=len(pairs))  # scoring reports (context, choice) pairs, not examples
    bar.unit = "pair"
    scores, cut = loglikelihoods(model, tokenizer, pairs, cfg.batch_size, bar.update)
    records = []
    for ex, context, (s, e) in zip(examples, contexts, spans):
        logprobs = [lp for lp, _ in scores[s:e]]
        choices = prompts.LETTERS if mmlu else ex["choices"]
        record = {"answer": ex["answer"], "logprobs": logprobs, **choice_scores(logprobs, choices, ex["answer"]),
                  "truncated": int(any(cut[s:e])), **_prompt(context, cfg)}
        if mmlu:
            record["subject"] = ex["subject"]
            del record["acc_norm"]  # single letters: normalizing by length changes nothing
        records.append(record)
    return records


def _ppl_records(model, tokenizer, task: TaskData, examples, cfg: EvalConfig, bar: tqdm) -> list[dict]:
    if cfg.ppl_stride > model.args.max_seq_len:
        raise ConfigError("eval.ppl_stride", cfg.ppl_stride, f"at most model.max_seq_len={model.args.max_seq_len}")
    texts = [ex["text"] for ex in examples]
    bar.reset(total=None)  # the window count is known only after tokenizing
    bar.unit = "window"
    scored = rolling_loglikelihoods(model, tokenizer, texts, cfg.ppl_stride, cfg.batch_size, bar.update,
                                    lambda n: bar.reset(total=n))
    return [{"nll": -lp, "tokens": n, "bytes": len(t.encode("utf-8"))} for t, (lp, n) in zip(texts, scored)]


def _bits_records(model, tokenizer, task: TaskData, examples, cfg: EvalConfig, bar: tqdm) -> list[dict]:
    """Per fact: the value's cross-entropy given its question, in bits (teacher
    forced, summed over the value's tokens), and the bits that shows stored."""
    pairs = [(ex["question"], " " + ex["answer"]) for ex in examples]
    scores, cut = loglikelihoods(model, tokenizer, pairs, cfg.batch_size, bar.update)
    records = []
    for ex, (logprob, greedy), truncated in zip(examples, scores, cut):
        ce = -logprob / math.log(2)
        records.append({"question": ex["question"], "answer": ex["answer"], "values": ex["values"],
                        "ce_bits": ce, "stored_bits": stored_bits(ce, ex["values"]),
                        "exact_match": float(greedy), "truncated": int(truncated)})
    return records


RECORDERS = {"qa": _qa_records, "mmlu": _choice_records, "choice": _choice_records, "ppl": _ppl_records,
             "bits": _bits_records}


# ----------------------------------------------------------------- aggregate
def _truncated(records: list[dict]) -> int:
    return sum(r["truncated"] for r in records)


def _aggregate_qa(name: str, records: list[dict]) -> dict[str, dict]:
    return {name: {"exact_match": mean([r["exact_match"] for r in records]), "f1": mean([r["f1"] for r in records]),
                   "n": len(records), "truncated": _truncated(records),
                   **phrasing_summary(exact_match_by(records, "phrasing"))}}


def _aggregate_choice(name: str, records: list[dict]) -> dict[str, dict]:
    return {name: {"acc": mean([r["acc"] for r in records]), "acc_norm": mean([r["acc_norm"] for r in records]),
                   "n": len(records), "truncated": _truncated(records)}}


def _aggregate_mmlu(name: str, records: list[dict]) -> dict[str, dict]:
    """Micro average (every question counts once) as the headline, as in the MMLU
    paper; the macro average over subjects and each subject's accuracy too."""
    subjects: dict[str, list[float]] = {}
    for r in records:
        subjects.setdefault(r["subject"], []).append(r["acc"])
    out = {name: {"acc": mean([r["acc"] for r in records]), "acc_macro": mean([mean(v) for v in subjects.values()]),
                  "n": len(records), "truncated": _truncated(records)}}
    for subject in sorted(subjects):
        out[f"{name}/{subject}"] = {"acc": mean(subjects[subject]), "n": len(subjects[subject])}
    return out


def _aggregate_ppl(name: str, records: list[dict]) -> dict[str, dict]:
    nll, tokens, n_bytes = (sum(r[k] for r in records) for k in ("nll", "tokens", "bytes"))
    return {name: {**perplexity_metrics(nll, tokens, n_bytes), "n": len(records), "tokens": tokens, "bytes": n_bytes}}


def _aggregate_bits(name: str, records: list[dict]) -> dict[str, dict]:
    stored = sum(r["stored_bits"] for r in records)
    capacity = sum(math.log2(r["values"]) for r in records)
    return {name: {"stored_bits": stored, "corpus_bits": capacity, "stored_fraction": stored / capacity,
                   "exact_match": mean([r["exact_match"] for r in records]),
                   "ce_bits": mean([r["ce_bits"] for r in records]), "n": len(records),
                   "truncated": _truncated(records)}}


AGGREGATORS = {"qa": _aggregate_qa, "mmlu": _aggregate_mmlu, "choice": _aggregate_choice, "ppl": _aggregate_ppl,
               "bits": _aggregate_bits}
