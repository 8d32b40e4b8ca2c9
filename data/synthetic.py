"""A deterministic synthetic factual corpus: biographies of fictional people + NQ-open style QA.

    python -m memlm.data.synthetic --people 2000 --out data_cache/bios

writes `train.jsonl` ({"text": biography}, `docs_per_person` paraphrased
biographies per person, sentences in random order), `qa.jsonl`
({"question": ..., "answer": [...]}, one question per person and attribute, in
NQ-open format) and `people.jsonl` (the facts, for analysis). The same
(people, docs_per_person, seed) always gives byte-identical files.

Every person has a unique name and seven attributes drawn uniformly from large
value sets (see synthetic_vocab), so recall is limited by model capacity.
Questions use templates that never occur in the biographies (synthetic_templates).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import asdict, dataclass

from tqdm import tqdm

from memlm.data import synthetic_vocab as vocab
from memlm.data.synthetic_templates import ATTRIBUTES, BIO_TEMPLATES, QUESTION_TEMPLATES
from memlm.errors import ConfigError


@dataclass(frozen=True)
class Person:
    name: str
    gender: str  # "f" | "m": picks the pronouns
    birth_date: str  # "March 14, 1962"
    birth_city: str
    university: str
    major: str
    employer: str
    occupation: str
    food: str


def max_people() -> int:
    return len(vocab.FIRST_NAMES) * len(vocab.LAST_NAMES)


def make_people(n: int, seed: int) -> list[Person]:
    if not 0 < n <= max_people():
        raise ConfigError("people", n, f"an integer in [1, {max_people()}] (unique first x last names)")
    rng = random.Random(seed)
    cities, companies, universities = vocab.cities(), vocab.companies(), vocab.universities()
    people = []
    for idx in rng.sample(range(max_people()), n):
        first, last = divmod(idx, len(vocab.LAST_NAMES))
        month = rng.randrange(12)
        date = f"{vocab.MONTHS[month]} {rng.randint(1, vocab.DAYS_IN_MONTH[month])}, {rng.choice(vocab.BIRTH_YEARS)}"
        people.append(Person(
            name=f"{vocab.FIRST_NAMES[first]} {vocab.LAST_NAMES[last]}",
            gender=rng.choice("fm"),
            birth_date=date,
            birth_city=rng.choice(cities),
            university=rng.choice(universities),
            major=rng.choice(vocab.MAJORS),
            employer=rng.choice(companies),
            occupation=rng.choice(vocab.OCCUPATIONS),
            food=rng.choice(vocab.FOODS),
        ))
    return people


def _article(value: str) -> str:
    return ("an " if value[0] in "aeiou" else "a ") + value


def biography(person: Person, rng: random.Random) -> str:
    """One paraphrase: a random template per attribute, random sentence order, name or pronoun."""
    he, his = ("She", "Her") if person.gender == "f" else ("He", "His")
    order = list(ATTRIBUTES)
    rng.shuffle(order)
    sentences = []
    for i, attribute in enumerate(order):
        use_name = i == 0 or rng.random() < 0.5  # the first sentence always names the person
        value = getattr(person, attribute)
        sentences.append(rng.choice(BIO_TEMPLATES[attribute]).format(
            s=person.name if use_name else he,
            p=f"{person.name}'s" if use_name else his,
            q=his.lower(),
            v=value,
            a=_article(value),
        ))
    return " ".join(sentences)


def answers(person: Person, attribute: str) -> list[str]:
    value = getattr(person, attribute)
    if attribute == "birth_date":  # accept "14 March 1962" as well
        month_day, year = value.split(", ")
        month, day = month_day.split(" ")
        return [value, f"{day} {month} {year}"]
    return [value]


def generate(people: int, docs_per_person: int = 4, seed: int = 0) -> tuple[list[Person], list[str], list[dict]]:
    """(people, training documents, QA items), all deterministic in the arguments."""
    if docs_per_person <= 0:
        raise ConfigError("docs_per_person", docs_per_person, "a positive integer")
    persons = make_people(people, seed)
    rng = random.Random(seed + 1)
    docs = [biography(p, rng) for p in persons for _ in range(docs_per_person)]
    rng.shuffle(docs)  # interleave people, so a file prefix is not a handful of people
    qa = [
        {"question": rng.choice(QUESTION_TEMPLATES[a]).format(n=p.name), "answer": answers(p, a)}
        for p in persons for a in ATTRIBUTES
    ]
    return persons, docs, qa


def _write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_corpus(out_dir: str, people: int, docs_per_person: int = 4, seed: int = 0) -> dict[str, str]:
    persons, docs, qa = generate(people, docs_per_person, seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("train", "qa", "people")}
    _write_jsonl(paths["people"], [asdict(p) for p in persons])
    _write_jsonl(paths["qa"], qa)
    _write_jsonl(paths["train"], [{"text": d} for d in tqdm(docs, desc="writing", unit="doc", disable=len(docs) < 10000)])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.data.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", type=int, required=True, help=f"number of people (at most {max_people()})")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--docs-per-person", type=int, default=4, help="paraphrased biographies per person")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_corpus(args.out, args.people, args.docs_per_person, args.seed)
    sizes = {k: os.path.getsize(p) for k, p in paths.items()}
    print(f"wrote {args.people * args.docs_per_person:,} biographies of {args.people:,} people "
          f"({sizes['train'] / 1e6:.1f} MB) to {paths['train']}, {args.people * len(ATTRIBUTES):,} questions "
          f"to {paths['qa']}, facts to {paths['people']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
