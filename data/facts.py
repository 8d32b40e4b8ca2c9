"""A random-facts corpus: knowledge that can only be stored, never inferred.

    python -m memlm.data.facts --entities 8000 --attributes 4 --values 256 --out data_cache/facts

N invented entities, A attributes each, every value drawn independently and
uniformly from that attribute's V candidates: the corpus holds exactly
N * A * log2(V) bits, and no rule, pattern or prior knowledge predicts any of
them. It is the corpus of the knowledge-capacity study (docs/results.md), in
the spirit of Allen-Zhu & Li, "Physics of Language Models: Part 3.3" (2024).

Writes into --out:
- `train.jsonl`: one document per fact, in the evaluation's prompt layout
  ({"text": "Q: What is the metal of Kavoru Tesilan?\\nA: rimo"}), shuffled.
  Compact on purpose: training tokens go to facts, not filler.
- `facts.jsonl`: one record per fact, in the same order as the entities
  ({"question", "answer", "entity", "attribute", "values": V}); the
  `facts_bits` evaluation task scores the model on these (memlm.evals).

The same (entities, attributes, values, seed) always gives byte-identical
files; `generator_digest()` names everything else that shapes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys

from memlm.errors import ConfigError, entry_point
from memlm.files import atomic_write_text

GENERATOR_VERSION = 1  # bump when the generation logic (not only the word lists) changes

# Attribute names: plain one-word nouns, so a question costs few tokens.
ATTRIBUTES = ("metal", "color", "animal", "city", "tool", "fruit", "sport", "river",
              "planet", "song", "gem", "tree", "dance", "drink", "mood", "number")
# Names and values are pseudo-words built from these syllables: they carry no
# meaning a model could have learned elsewhere, and there are enough of them
# (75 syllables; 75**3 three-syllable names) for any N trainable here.
_CONSONANTS = "bdfgklmnprstvwz"
_VOWELS = "aeiou"
SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)
MAX_VALUES = len(SYLLABLES) ** 2  # two-syllable value words
MAX_ENTITIES = (len(SYLLABLES) ** 3) ** 2  # a three-syllable first and last name


def generator_digest() -> str:
    """8 hex digits of everything that shapes the corpus besides its size and
    seed: part of the cache folder name, so a corpus cached by an older memlm
    is regenerated, not reused."""
    parts = [GENERATOR_VERSION, ATTRIBUTES, SYLLABLES, question("E", "a"), document("E", "a", "v")]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:8]


def question(entity: str, attribute: str) -> str:
    """The prompt both training text and evaluation use (Q/A layout of memlm.evals.prompts)."""
    return f"Q: What is the {attribute} of {entity}?\nA:"


def document(entity: str, attribute: str, value: str) -> str:
    return f"{question(entity, attribute)} {value}"


# Phrasings of one fact for fine-tuning on paraphrases (memlm.data.continual's facts_b_para): the
# evaluation's Q/A layout first, then statements and other questions. Written for this corpus: Lin et
# al.'s paraphrases come from a language model; templates keep the corpus reproducible byte for byte.
PHRASINGS = (
    "Q: What is the {a} of {e}?\nA: {v}",
    "The {a} of {e} is {v}.",
    "{e}'s {a} is {v}.",
    "{v} is the {a} of {e}.",
    "Q: Which {a} does {e} have?\nA: {v}",
    "Asked for the {a} of {e}, the answer is {v}.",
    "{e} has {v} as {a}.",
    "Q: Name the {a} of {e}.\nA: {v}",
)


def paraphrases(entity: str, attribute: str, value: str) -> list[str]:
    """The fact in every phrasing of PHRASINGS, the evaluation's layout first."""
    return [p.format(e=entity, a=attribute, v=value) for p in PHRASINGS]


def check_sizes(entities: int, attributes: int, values: int, prefix: str = "data.facts") -> None:
    if not 0 < entities <= MAX_ENTITIES:
        raise ConfigError(f"{prefix}.entities", entities, f"an integer in [1, {MAX_ENTITIES}]")
    if not 0 < attributes <= len(ATTRIBUTES):
        raise ConfigError(f"{prefix}.attributes", attributes,
                          f"an integer in [1, {len(ATTRIBUTES)}] (attribute names: {', '.join(ATTRIBUTES)})")
    if not 2 <= values <= MAX_VALUES:
        raise ConfigError(f"{prefix}.values", values,
                          f"an integer in [2, {MAX_VALUES}] (candidates per attribute; 1 would hold no information)")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables))


def _unique_words(rng: random.Random, n: int, make) -> list[str]:
    seen: set[str] = set()
    words = []
    while len(words) < n:
        word = make()
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def generate(entities: int, attributes: int = 4, values: int = 256, seed: int = 0) -> list[dict]:
    """The facts, entity by entity: [{"question", "answer", "entity", "attribute", "values"}]."""
    check_sizes(entities, attributes, values)
    rng = random.Random(seed)
    names = _unique_words(rng, entities, lambda: f"{_word(rng, 3).capitalize()} {_word(rng, 3).capitalize()}")
    # Each attribute has its own V candidate words (the same word may serve two attributes).
    candidates = {a: _unique_words(rng, values, lambda: _word(rng, 2)) for a in ATTRIBUTES[:attributes]}
    return [{"question": question(name, a), "answer": rng.choice(candidates[a]), "entity": name,
             "attribute": a, "values": values}
            for name in names for a in ATTRIBUTES[:attributes]]


def capacity_bits(facts: int, values: int) -> float:
    """What a corpus of `facts` facts with `values` candidates each holds: facts * log2(values)."""
    return facts * math.log2(values)


def write_corpus(out_dir: str, entities: int, attributes: int = 4, values: int = 256, seed: int = 0) -> dict[str, str]:
    facts = generate(entities, attributes, values, seed)
    docs = [document(f["entity"], f["attribute"], f["answer"]) for f in facts]
    random.Random(seed + 1).shuffle(docs)  # a file prefix is not a handful of entities
    os.makedirs(out_dir, exist_ok=True)
    paths = {"train": os.path.join(out_dir, "train.jsonl"), "facts": os.path.join(out_dir, "facts.jsonl")}
    atomic_write_text(paths["facts"], "".join(json.dumps(f) + "\n" for f in facts))
    atomic_write_text(paths["train"], "".join(json.dumps({"text": d}) + "\n" for d in docs))
    return paths


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.data.facts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, required=True, help="number of invented entities (N)")
    parser.add_argument("--attributes", type=int, default=4, help=f"attributes per entity (A, 1 to {len(ATTRIBUTES)})")
    parser.add_argument("--values", type=int, default=256, help="candidate values per attribute (V)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    paths = write_corpus(args.out, args.entities, args.attributes, args.values, args.seed)
    n = args.entities * args.attributes
    print(f"wrote {n:,} facts ({args.entities:,} entities x {args.attributes} attributes, "
          f"{args.values} values each: {capacity_bits(n, args.values):,.0f} bits) to {paths['train']}, "
          f"questions to {paths['facts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
