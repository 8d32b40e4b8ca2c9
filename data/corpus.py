"""Turn a DataConfig into token sources: random tokens, the synthetic corpus, raw files, or shards.

`open_corpus(cfg, split)` does every file access the loader needs up front, so
a bad path, a tokenizer mismatch or a bad record fails when the loader is
built, not in the middle of training.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
from dataclasses import dataclass, field

from memlm.data.config import DataConfig, SourceConfig
from memlm.data.encode import EncodedUnit, encode_unit
from memlm.data.shards import SPLITS, check_tokenizer, load_split, read_manifest, token_dtype
from memlm.data.sources import expand_paths, plan_units
from memlm.data.stats import SkipStats
from memlm.data.stream import RandomTokens, TokenSource
from memlm.data.tokenizer import Tokenizer, train_tokenizer
from memlm.errors import ConfigError

RAW_CHUNK_BYTES = 16 << 20  # unit size in small-corpus mode: enough pieces to spread over workers


@dataclass
class Corpus:
    sources: list  # TokenSource | RandomTokens, in mixture order
    weights: list[float]
    vocab_size: int
    tokenizer: Tokenizer | None = None
    stats: dict[str, SkipStats] = field(default_factory=dict)  # per source, from tokenizing/preparing


def open_corpus(cfg: DataConfig, split: str = "train") -> Corpus:
    if split not in SPLITS:
        raise ConfigError("split", split, f"one of: {', '.join(SPLITS)}")
    if cfg.kind == "random":
        # val draws from its own stream, so it never repeats a training batch
        source = RandomTokens("random", cfg.vocab_size, [cfg.seed, SPLITS.index(split)])
        return Corpus([source], [1.0], cfg.vocab_size)
    if cfg.kind == "shards":
        return _open_shards(cfg, split)
    if cfg.kind == "synthetic":
        paths = materialize_synthetic(cfg)
        src = SourceConfig(name="synthetic", path=paths["train"], format="jsonl")
        return _open_raw(cfg, [src], paths["tokenizer"], split)
    if cfg.kind == "facts":
        paths = materialize_facts(cfg)
        src = SourceConfig(name="facts", path=paths["train"], format="jsonl")
        return _open_raw(cfg, [src], paths["tokenizer"], split)
    return _open_raw(cfg, cfg.sources, cfg.tokenizer, split)


def _open_shards(cfg: DataConfig, split: str) -> Corpus:
    manifest = read_manifest(cfg.shards_dir)
    tok = Tokenizer(cfg.tokenizer or manifest["tokenizer"]["path"])
    check_tokenizer(manifest, tok, cfg.shards_dir)
    names = cfg.source_names() if cfg.sources else sorted(manifest["sources"])
    weights = [s.weight for s in cfg.sources] or [manifest["sources"][n]["weight"] for n in names]
    sources, stats = [], {}
    for name in names:
        sources.append(TokenSource(name, load_split(cfg.shards_dir, manifest, name, split), cfg.seed, cfg.shuffle))
        stats[name] = SkipStats.from_dict(manifest["sources"][name]["stats"])
    return Corpus(sources, weights, tok.vocab_size, tok, stats)


def _encode_job(args: tuple) -> EncodedUnit:
    unit, tokenizer_path, on_error, val_fraction = args
    tok = Tokenizer(tokenizer_path)
    return encode_unit(unit, tok, on_error, val_fraction, token_dtype(tok.vocab_size))


def _open_raw(cfg: DataConfig, sources: list[SourceConfig], tokenizer_path: str, split: str) -> Corpus:
    """Small-corpus mode: tokenize every document into memory now (no preparation step)."""
    tok = Tokenizer(tokenizer_path)
    names = [s.name or f"source{i}" for i, s in enumerate(sources)]
    plans = [
        plan_units(name, expand_paths(src.path, f"data.sources[{i}].path"), src.format, src.text_field, RAW_CHUNK_BYTES)
        for i, (name, src) in enumerate(zip(names, sources))
    ]
    jobs = [(unit, tokenizer_path, cfg.on_error, cfg.val_fraction) for units in plans for unit in units]
    if cfg.num_workers > 1 and len(jobs) > 1:
        with mp.get_context("spawn").Pool(min(cfg.num_workers, len(jobs))) as pool:
            encoded = pool.map(_encode_job, jobs)
    else:
        encoded = [_encode_job(job) for job in jobs]
    token_sources, stats = [], {}
    for name in names:
        mine = [e for e in encoded if e.unit.source == name]
        stats[name] = SkipStats()
        for e in mine:
            stats[name].merge(e.stats)
        arrays = [e.splits[split] for e in mine if len(e.splits[split][0])]
        if not arrays and split == "val":
            raise ConfigError("data.val_fraction", cfg.val_fraction,
                              f"a fraction > 0 that leaves source {name} some validation documents")
        token_sources.append(TokenSource(name, arrays, cfg.seed, cfg.shuffle))
    return Corpus(token_sources, [s.weight for s in sources], tok.vocab_size, tok, stats)


def check_inputs(cfg: DataConfig) -> None:
    """The files a loader of `cfg` will open exist and parse, checked without
    tokenizing or generating anything (shards: the manifest and its tokenizer;
    raw: every source path and the tokenizer; synthetic/facts: a given tokenizer)."""
    if cfg.kind == "shards":
        manifest = read_manifest(cfg.shards_dir)
        check_tokenizer(manifest, _tokenizer(cfg.tokenizer or manifest["tokenizer"]["path"]), cfg.shards_dir)
    elif cfg.kind == "raw":
        _tokenizer(cfg.tokenizer)
        for i, src in enumerate(cfg.sources):
            expand_paths(src.path, f"data.sources[{i}].path")
    elif cfg.kind in ("synthetic", "facts"):
        _check_given_tokenizer(cfg)


def _tokenizer(path: str) -> Tokenizer:
    try:
        return Tokenizer(path)
    except ConfigError as err:  # named as the key a user sets
        raise ConfigError("data.tokenizer", path, err.valid) from None


def _check_given_tokenizer(cfg: DataConfig) -> None:
    """synthetic/facts use data.tokenizer when it is set (else they train their own)."""
    if cfg.tokenizer and not os.path.isfile(cfg.tokenizer):
        raise ConfigError("data.tokenizer", cfg.tokenizer, f"an existing sentencepiece .model, or empty: data.kind="
                          f"{cfg.kind} then trains the corpus' own tokenizer into data.cache_dir")


def synthetic_dir(cfg: DataConfig) -> str:
    from memlm.data.synthetic import generator_digest

    syn = cfg.synthetic
    qa = f"-q{syn.qa_fraction:g}" if syn.qa_fraction > 0 else ""
    if syn.qa_fraction > 0 and syn.qa_docs_per_person != 1:
        qa += f"x{syn.qa_docs_per_person}"
    # The generator's digest: a corpus cached by an older memlm is regenerated, not reused.
    name = f"synthetic-p{syn.people}-d{syn.docs_per_person}-s{syn.seed}{qa}-g{generator_digest()}"
    return os.path.join(cfg.cache_dir, name)


def materialize_synthetic(cfg: DataConfig) -> dict[str, str]:
    """Write the synthetic corpus (+ a tokenizer unless cfg.tokenizer is set) under cache_dir once."""
    from memlm.data.synthetic import write_corpus

    syn = cfg.synthetic
    names = ("train", "qa", "qa_seen", "qa_unseen", "qa_trained")
    return _materialize(cfg, synthetic_dir(cfg), names, ("train", "qa"), syn.seed, lambda folder: write_corpus(
        folder, syn.people, syn.docs_per_person, syn.seed, syn.qa_fraction, syn.qa_docs_per_person))


def facts_dir(cfg: DataConfig) -> str:
    from memlm.data.facts import generator_digest

    f = cfg.facts
    name = f"facts-n{f.entities}-a{f.attributes}-v{f.values}-s{f.seed}-g{generator_digest()}"
    return os.path.join(cfg.cache_dir, name)


def materialize_facts(cfg: DataConfig) -> dict[str, str]:
    """Write the random-facts corpus (+ a tokenizer unless cfg.tokenizer is set) under cache_dir once."""
    from memlm.data.facts import write_corpus

    f = cfg.facts
    return _materialize(cfg, facts_dir(cfg), ("train", "facts"), ("train", "facts"), f.seed,
                        lambda folder: write_corpus(folder, f.entities, f.attributes, f.values, f.seed))


def _materialize(cfg: DataConfig, folder: str, names: tuple[str, ...], required: tuple[str, ...], seed: int,
                 write) -> dict[str, str]:
    """{name: path of <name>.jsonl, "tokenizer": path} of a generated corpus in `folder`,
    written by `write(folder)` unless its `required` files exist.

    Deterministic content and an exclusive file lock make it safe for every rank
    of a job to call this at the same time: one writes, the others reuse.
    """
    _check_given_tokenizer(cfg)
    os.makedirs(folder, exist_ok=True)
    paths = {name: os.path.join(folder, f"{name}.jsonl") for name in names}
    paths["tokenizer"] = cfg.tokenizer or os.path.join(folder, f"tokenizer-v{cfg.vocab_size}.model")
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(os.path.isfile(paths[name]) for name in required):
            write(folder)
        if not os.path.isfile(paths["tokenizer"]):
            with open(paths["train"]) as fh:
                docs = (json.loads(line)["text"] for line in fh)
                # hard_vocab_limit=False: a small corpus may support fewer pieces than asked for.
                train_tokenizer(docs, paths["tokenizer"], cfg.vocab_size, character_coverage=1.0,
                                input_sentence_size=0, seed=seed, num_threads=1, hard_vocab_limit=False,
                                keys={"vocab_size": "data.vocab_size", "character_coverage": ""})
    return paths
