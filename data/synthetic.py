"""A deterministic synthetic factual corpus: biographies of fictional people + NQ-open style QA.

    python -m memlm.data.synthetic --people 2000 --out data_cache/bios

writes `train.jsonl` ({"text": biography}, `docs_per_person` paraphrased
biographies per person, sentences in random order), `qa.jsonl`
({"question": ..., "answer": [...], "phrasing": "<attribute>/q<i>"}, one
question per person and attribute, in NQ-open format plus the name of the
question's template, so the evaluation can score each phrasing) and
`people.jsonl` (the facts, for analysis). The same (people, docs_per_person,
seed, qa_fraction, qa_docs_per_person) always gives byte-identical files.

With `--qa-fraction f > 0` the first f of the people also get
`--qa-docs-per-person` training documents of question/answer pairs
("Q: ...?\nA: ...", the evaluation's prompt layout) in phrasings disjoint from
the evaluation's (TRAIN_QUESTION_TEMPLATES), each document asking every fact
in another phrasing: the model then learns the format and to answer from
stored facts, as in pretraining data that mixes encyclopedic text with QA.
`qa_seen.jsonl` and `qa_unseen.jsonl` split `qa.jsonl` into those people and
the biography-only rest; `qa_trained.jsonl` asks the seen people's facts in
the phrasings of their first training document (recall of trained text: it
separates what a model stored from whether it understands a new phrasing).

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
from memlm.data.synthetic_templates import (
    ATTRIBUTES,
    BIO_TEMPLATES,
    QUESTION_TEMPLATES,
    TRAIN_QUESTION_TEMPLATES,
)
from memlm.errors import ConfigError, entry_point
from memlm.files import atomic_write_text

# A seen person's QA documents each ask a fact in another training phrasing.
MAX_QA_DOCS = min(len(t) for t in TRAIN_QUESTION_TEMPLATES.values())


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


GENERATOR_VERSION = 4  # bump when the generation logic (not only templates or values) changes


def generator_digest() -> str:
    """8 hex digits of everything that shapes the corpus (templates, value sets):
    part of the cache folder name, so that a cached corpus is never reused
    after the generator changed."""
    import hashlib

    parts = [GENERATOR_VERSION, BIO_TEMPLATES, QUESTION_TEMPLATES, TRAIN_QUESTION_TEMPLATES,
             {k: v for k, v in sorted(vars(vocab).items()) if k.isupper()},
             [vocab.cities(), vocab.companies(), vocab.universities()]]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=list).encode()).hexdigest()[:8]


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


def qa_people(people: int, qa_fraction: float) -> int:
    """How many people (the first ones of make_people's list) get QA training text."""
    if not 0.0 <= qa_fraction <= 1.0:
        raise ConfigError("qa_fraction", qa_fraction, "a fraction in [0, 1]")
    return round(people * qa_fraction)


def qa_phrasings(person_index: int, seed: int, n_docs: int) -> list[dict[str, str]]:
    """For each of a seen person's n_docs QA documents, the training template
    of each attribute: distinct across the documents (n_docs <= the templates
    per attribute). Seeded per person, so qa_trained.jsonl can be rebuilt."""
    if not 1 <= n_docs <= MAX_QA_DOCS:
        raise ConfigError("qa_docs_per_person", n_docs,
                          f"an integer in [1, {MAX_QA_DOCS}] (one training phrasing per attribute and document)")
    rng = random.Random(f"qa-phrasings-{seed}-{person_index}")
    picks = {a: rng.sample(TRAIN_QUESTION_TEMPLATES[a], n_docs) for a in ATTRIBUTES}
    return [{a: picks[a][d] for a in ATTRIBUTES} for d in range(n_docs)]


def qa_document(person: Person, phrasing: dict[str, str], rng: random.Random) -> str:
    """All of a person's facts as question/answer pairs, in random order, laid
    out like evaluation prompts (evals.prompts.qa_text + " " + answer)."""
    order = list(ATTRIBUTES)
    rng.shuffle(order)
    pairs = [f"Q: {phrasing[a].format(n=person.name)}\nA: {getattr(person, a)}" for a in order]
    return "\n\n".join(pairs)


def phrasing_id(attribute: str, template: str) -> str:
    """A question template's name in QA records ("phrasing"): `<attribute>/q<i>`
    for the i-th held-out template, `<attribute>/t<i>` for the i-th training one.
    The evaluation reports exact match per phrasing."""
    if template in QUESTION_TEMPLATES[attribute]:
        return f"{attribute}/q{QUESTION_TEMPLATES[attribute].index(template)}"
    return f"{attribute}/t{TRAIN_QUESTION_TEMPLATES[attribute].index(template)}"


def _question(person: Person, attribute: str, template: str) -> dict:
    return {"question": template.format(n=person.name), "answer": answers(person, attribute),
            "phrasing": phrasing_id(attribute, template)}


def trained_questions(persons: list[Person], seed: int, qa_docs_per_person: int) -> list[dict]:
    """The given (seen) people's facts asked in their first QA document's phrasings."""
    firsts = [qa_phrasings(i, seed, qa_docs_per_person)[0] for i in range(len(persons))]
    return [_question(p, a, first[a]) for p, first in zip(persons, firsts) for a in ATTRIBUTES]


def generate(
    people: int, docs_per_person: int = 4, seed: int = 0, qa_fraction: float = 0.0,
    qa_docs_per_person: int = 1,
) -> tuple[list[Person], list[str], list[dict]]:
    """(people, training documents, QA items), all deterministic in the arguments.
    QA items are in people order, so the first qa_people(...) * len(ATTRIBUTES)
    are the questions about people with QA training text."""
    if docs_per_person <= 0:
        raise ConfigError("docs_per_person", docs_per_person, "a positive integer")
    qa_phrasings(0, seed, qa_docs_per_person)  # validates qa_docs_per_person up front
    n_seen = qa_people(people, qa_fraction)
    persons = make_people(people, seed)
    rng = random.Random(seed + 1)
    docs = [biography(p, rng) for p in persons for _ in range(docs_per_person)]
    rng.shuffle(docs)  # interleave people, so a file prefix is not a handful of people
    qa = [_question(p, a, rng.choice(QUESTION_TEMPLATES[a])) for p in persons for a in ATTRIBUTES]
    if n_seen:
        # Its own stream, so the biographies and questions do not depend on qa_fraction.
        qa_rng = random.Random(seed + 2)
        docs += [qa_document(p, phrasing, qa_rng) for i, p in enumerate(persons[:n_seen])
                 for phrasing in qa_phrasings(i, seed, qa_docs_per_person)]
        qa_rng.shuffle(docs)
    return persons, docs, qa


def _write_jsonl(path: str, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_corpus(
    out_dir: str, people: int, docs_per_person: int = 4, seed: int = 0, qa_fraction: float = 0.0,
    qa_docs_per_person: int = 1,
) -> dict[str, str]:
    persons, docs, qa = generate(people, docs_per_person, seed, qa_fraction, qa_docs_per_person)
    os.makedirs(out_dir, exist_ok=True)
    names = ("train", "qa", "people") + (("qa_seen", "qa_unseen", "qa_trained") if qa_fraction > 0 else ())
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in names}
    _write_jsonl(paths["people"], [asdict(p) for p in persons])
    _write_jsonl(paths["qa"], qa)
    if qa_fraction > 0:
        n_seen = qa_people(people, qa_fraction)
        cut = n_seen * len(ATTRIBUTES)
        _write_jsonl(paths["qa_seen"], qa[:cut])
        _write_jsonl(paths["qa_unseen"], qa[cut:])
        _write_jsonl(paths["qa_trained"], trained_questions(persons[:n_seen], seed, qa_docs_per_person))
    _write_jsonl(paths["train"],
                 [{"text": d} for d in tqdm(docs, desc="writing", unit="doc", disable=len(docs) < 10000)])
    return paths


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.data.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", type=int, required=True, help=f"number of people (at most {max_people()})")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--docs-per-person", type=int, default=4, help="paraphrased biographies per person")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qa-fraction", type=float, default=0.0,
                        help="fraction of people who also get QA-format training text (0 to 1)")
    parser.add_argument("--qa-docs-per-person", type=int, default=1,
                        help=f"QA documents per such person, each in other phrasings (1 to {MAX_QA_DOCS})")
    args = parser.parse_args(argv)
    paths = write_corpus(args.out, args.people, args.docs_per_person, args.seed, args.qa_fraction,
                         args.qa_docs_per_person)
    sizes = {k: os.path.getsize(p) for k, p in paths.items()}
    n_qa = qa_people(args.people, args.qa_fraction)
    print(f"wrote {args.people * args.docs_per_person:,} biographies of {args.people:,} people "
          f"(+ QA text for {n_qa:,}) "
          f"({sizes['train'] / 1e6:.1f} MB) to {paths['train']}, {args.people * len(ATTRIBUTES):,} questions "
          f"to {paths['qa']}, facts to {paths['people']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
