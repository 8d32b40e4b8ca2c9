"""Helpers shared by the tests/test_evals_*.py files (no tests here): a
sentencepiece tokenizer trained on generated text, a tiny random model, and
writers of small task files in every supported format."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from memlm.config.run import compose
from memlm.data.synthetic import generate
from memlm.data.tokenizer import train_tokenizer
from memlm.model import build_model

VOCAB = 384


def make_tokenizer(folder: Path):
    """A byte-fallback BPE model trained on synthetic biographies and questions (~1 s)."""
    _, docs, qa = generate(60, 2, seed=3)
    texts = docs + [f"Q: {r['question']}\nA: {r['answer'][0]}" for r in qa]
    return train_tokenizer(texts, str(folder / "tok.model"), VOCAB, character_coverage=1.0,
                           input_sentence_size=0, num_threads=1, hard_vocab_limit=False)


def make_model(max_seq_len: int = 256, seed: int = 0, **overrides):
    args = [f"model.vocab_size={VOCAB}", f"model.max_seq_len={max_seq_len}", "data.seq_len=16"]
    args += [f"model.{k}={v}" for k, v in overrides.items()]
    return build_model(compose(args).model, seed=seed).eval()


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


QA_ROWS = [
    {"question": "who wrote the iliad", "answer": ["Homer"]},
    {"question": "what is the capital of france", "answer": ["Paris", "paris, france"]},
    {"question": "how many legs does a spider have", "answer": ["eight", "8"]},
    {"question": "which planet is known as the red planet", "answer": ["Mars"]},
    {"question": "what colour is the sky", "answer": ["blue"]},
    {"question": "who painted the mona lisa", "answer": ["Leonardo da Vinci", "da Vinci"]},
]

MMLU_ROWS = [
    ("What is 2 + 2?", "3", "4", "5", "6", "B"),
    ("Which gas do plants absorb?", "Oxygen", "Nitrogen", "Carbon dioxide", "Helium", "C"),
    ("What is the boiling point of water at sea level?", "100 C", "50 C", "0 C", "200 C", "A"),
    ("How many sides does a hexagon have?", "5", "8", "7", "6", "D"),
]

CHOICE_ROWS = [
    {"question": "To open a jar,", "choices": ["twist the lid", "eat the lid"], "answer": 0},
    {"context": "The man puts on his shoes and", "choices": ["walks out the door.", "melts into the floor."],
     "answer": 0},
    {"question": "Which is heavier?", "choices": ["a feather", "a brick", "a leaf"], "answer": 1},
    {"question": "Where do fish live?", "choices": ["in trees", "in water"], "answer": 1},
]


def write_mmlu_csv(root: Path, subjects: dict[str, list[tuple]], split: str) -> None:
    folder = root / "mmlu" / split
    folder.mkdir(parents=True, exist_ok=True)
    for subject, rows in subjects.items():
        with open(folder / f"{subject}_{split}.csv", "w", newline="") as fh:
            csv.writer(fh).writerows(rows)


def train_tiny_run(dump_dir: Path, cache_dir: Path) -> Path:
    """A 2-step run on the synthetic corpus (a few seconds): a real checkpoint and tokenizer."""
    from memlm.train.trainer import Trainer

    cfg = compose(["model.vocab_size=512", "model.max_seq_len=256", "data=synthetic", "data.seq_len=64",
                   "data.micro_batch=2", f"data.cache_dir={cache_dir}", "data.synthetic.people=40",
                   "steps=2", "logging.wandb.mode=disabled", f"dump_dir={dump_dir}"])
    Trainer(cfg).fit()
    return dump_dir


def cli_rank_worker(rank: int, argv: list[str]) -> None:
    """One rank of `python -m memlm.evals` (spawned by distributed_workers.run_ranks)."""
    from memlm.evals.cli import main

    assert main(argv) == 0
