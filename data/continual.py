"""The corpora of a continual-learning study: old facts, new facts, general text, one tokenizer.

    python -m memlm.data.continual --out data_cache/continual [--entities 1000 --new-entities 200 \
        --rounds 5 --people 200]

A model is pretrained on general text plus facts A, then taught facts B
(entities it never saw) by a fine-tuning mode (docs/finetuning.md); the
study measures how much of B it learns and how much of A and of the general
text it keeps. For that the parts must share everything but their
entities: one `memlm.data.facts` draw of `entities + new_entities`
entities, so A and B have the same attributes and the same candidate values
per attribute; and one tokenizer trained on all training text, so a
checkpoint of the base model reads B's text with the tokens it was trained
with (the tokenizer has seen B's names as text, the model has not).

Writes into --out, each folder in the layout of a training source
(`train.jsonl` of {"text"}) and of an evaluation task (docs/evals.md):

- `bio/train.jsonl`: synthetic biographies (memlm.data.synthetic), the general
  text; with `--qa-fraction` of the people also QA-format text.
- `bio_heldout/test.jsonl`: one more paraphrase per person, never trained on
  (task `ppl:bio_heldout`, held-out perplexity).
- `bio_qa/test.jsonl`: questions about the people with QA text, in phrasings
  never trained on (task `qa:bio_qa`).
- `facts_a/`, `facts_b/`: `train.jsonl` and `facts.jsonl` (task `bits:<folder>`).
- `facts_b1/` ... `facts_b<rounds>/`: facts B split by entity into rounds,
  for teaching them one round after another.
- `facts_b_para/train.jsonl`, and `facts_b<r>_para/` for each round: facts
  B in every phrasing of `memlm.data.facts.PHRASINGS` (8), each fact's
  phrasings together and the facts in a shuffled order: read with
  `data.rows=documents data.shuffle=false data.micro_batch=8`, each batch is
  one fact's paraphrases (Lin et al.'s batches); `write_paraphrases` adds
  them to a folder written before they existed. Not in the tokenizer's text,
  so the tokenizer is the one without them.
- `tokenizer.model`, and `manifest.json` with the arguments and sizes.

The same arguments always give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from memlm.data import facts, synthetic
from memlm.data.tokenizer import train_tokenizer
from memlm.errors import ConfigError, entry_point
from memlm.files import atomic_write_text

HELDOUT_SEED_OFFSET = 100  # the held-out paraphrases' stream, apart from the training biographies'
PARAPHRASE_SEED_OFFSET = 200  # the order of the facts in facts_b_para, apart from the other shuffles


def _write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _write_facts(out: str, name: str, records: list[dict], seed: int) -> list[str]:
    """facts.jsonl (entity order) and train.jsonl (shuffled documents) of one part; its documents."""
    docs = [facts.document(r["entity"], r["attribute"], r["answer"]) for r in records]
    random.Random(seed + 1).shuffle(docs)
    _write_jsonl(os.path.join(out, name, "facts.jsonl"), records)
    _write_jsonl(os.path.join(out, name, "train.jsonl"), [{"text": d} for d in docs])
    return docs


def paraphrase_folder(part: str) -> str:
    """The folder of a facts part's paraphrases: facts_b -> facts_b_para, facts_b2 -> facts_b2_para."""
    return f"{part}_para"


def write_paraphrases(out: str, seed: int = 0, part: str = "facts_b") -> str:
    """`out`/<part>_para/train.jsonl from `out`/<part>/facts.jsonl (module docstring); its path."""
    with open(os.path.join(out, part, "facts.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    random.Random(seed + PARAPHRASE_SEED_OFFSET).shuffle(records)  # the facts; each fact's phrasings stay together
    rows = [{"text": text} for r in records for text in facts.paraphrases(r["entity"], r["attribute"], r["answer"])]
    path = os.path.join(out, paraphrase_folder(part), "train.jsonl")
    _write_jsonl(path, rows)
    return path


def write_study(out: str, entities: int = 1000, new_entities: int = 200, rounds: int = 5, people: int = 200,
                docs_per_person: int = 4, qa_fraction: float = 0.5, attributes: int = 4, values: int = 256,
                vocab_size: int = 1024, seed: int = 0) -> dict:
    """Write every part into `out`; returns the manifest."""
    if not 1 <= rounds <= new_entities:
        raise ConfigError("rounds", rounds, f"an integer in [1, new_entities={new_entities}]")
    if not 0 < qa_fraction <= 1:
        raise ConfigError("qa_fraction", qa_fraction, "a fraction in (0, 1] (bio_qa asks the people with QA text)")
    all_facts = facts.generate(entities + new_entities, attributes, values, seed)
    cut = entities * attributes
    texts = _write_facts(out, "facts_a", all_facts[:cut], seed)
    texts += _write_facts(out, "facts_b", all_facts[cut:], seed)
    per_round = -(-new_entities // rounds)
    for r in range(rounds):  # by entity: a round teaches all of its entities' facts
        part = all_facts[cut + r * per_round * attributes: cut + (r + 1) * per_round * attributes]
        _write_facts(out, f"facts_b{r + 1}", part, seed + r + 1)

    for part in ["facts_b", *(f"facts_b{r + 1}" for r in range(rounds))]:
        write_paraphrases(out, seed, part)
    persons, bios, qa = synthetic.generate(people, docs_per_person, seed, qa_fraction)
    _write_jsonl(os.path.join(out, "bio", "train.jsonl"), [{"text": d} for d in bios])
    rng = random.Random(seed + HELDOUT_SEED_OFFSET)
    heldout = [{"text": synthetic.biography(p, rng)} for p in persons]
    _write_jsonl(os.path.join(out, "bio_heldout", "test.jsonl"), heldout)
    seen = synthetic.qa_people(people, qa_fraction) * len(synthetic.ATTRIBUTES)
    _write_jsonl(os.path.join(out, "bio_qa", "test.jsonl"), qa[:seen])
    texts += bios

    tokenizer = os.path.join(out, "tokenizer.model")
    train_tokenizer(texts, tokenizer, vocab_size, character_coverage=1.0, input_sentence_size=0, seed=seed,
                    num_threads=1, hard_vocab_limit=False,
                    keys={"vocab_size": "--vocab-size", "character_coverage": ""})
    manifest = {"entities": entities, "new_entities": new_entities, "rounds": rounds, "people": people,
                "docs_per_person": docs_per_person, "qa_fraction": qa_fraction, "attributes": attributes,
                "values": values, "vocab_size": vocab_size, "seed": seed,
                "facts_generator": facts.generator_digest(), "synthetic_generator": synthetic.generator_digest(),
                "bits_a": facts.capacity_bits(cut, values),
                "bits_b": facts.capacity_bits(len(all_facts) - cut, values)}
    atomic_write_text(os.path.join(out, "manifest.json"), json.dumps(manifest, indent=1) + "\n")
    return manifest


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.data.continual", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--entities", type=int, default=1000, help="entities of facts A (pretraining)")
    parser.add_argument("--new-entities", type=int, default=200, help="entities of facts B (fine-tuning)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds facts B is split into, by entity")
    parser.add_argument("--people", type=int, default=200, help="people of the general biography text")
    parser.add_argument("--docs-per-person", type=int, default=4)
    parser.add_argument("--qa-fraction", type=float, default=0.5, help="people who also get QA-format text")
    parser.add_argument("--attributes", type=int, default=4)
    parser.add_argument("--values", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    m = write_study(args.out, args.entities, args.new_entities, args.rounds, args.people, args.docs_per_person,
                    args.qa_fraction, args.attributes, args.values, args.vocab_size, args.seed)
    print(f"wrote facts A ({m['entities']:,} entities, {m['bits_a']:,.0f} bits), facts B ({m['new_entities']:,} "
          f"entities in {m['rounds']} rounds, {m['bits_b']:,.0f} bits), biographies of {m['people']:,} people "
          f"and a {m['vocab_size']}-piece tokenizer to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
