"""Typed configuration of the data pipeline (the `data/` Hydra config group).

`kind` picks where tokens come from (see docs/data.md):

- `random`: uniform random tokens in [0, vocab_size) (smoke tests, throughput).
- `synthetic`: the synthetic biography corpus (memlm.data.synthetic), generated
  into `cache_dir` with its own tokenizer on first use, tokenized in memory.
- `facts`: the random-facts corpus (memlm.data.facts) of the knowledge-capacity
  study, generated and tokenized the same way.
- `raw`: the `sources` (JSONL, Parquet, text; .gz/.zst) tokenized in memory when
  the loader is built: the small-corpus mode, no preparation step.
- `shards`: pre-tokenized shards in `shards_dir` written by `python -m memlm.data.prepare`.

OmegaConf structured configs: dataclasses, `list[...]`, plain defaults only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memlm.errors import ConfigError

KINDS = ("random", "synthetic", "facts", "raw", "shards")
FORMATS = ("auto", "jsonl", "parquet", "text", "text_file")
ON_ERROR = ("raise", "skip")
# data.rows: how documents fill a batch's rows (memlm.data.loader). packed: back to back, a row may span
# documents; documents: one document per row from its start, the rest padding that is not trained on.
ROWS = ("packed", "documents")
IGNORE = -100  # the target of a padding position: not trained on (F.cross_entropy's ignore_index)
# Fields only some kinds read (the rest are shared): setting one for another kind is refused.
READ_BY = (("sources", ("raw", "shards")), ("shards_dir", ("shards",)),
           ("tokenizer", ("raw", "shards", "synthetic", "facts")), ("synthetic", ("synthetic",)),
           ("facts", ("facts",)))
# The smallest byte-fallback vocabulary: 256 byte pieces + unk/bos/eos/pad + a few merges.
MIN_SPM_VOCAB = 300


@dataclass
class SourceConfig:
    """One corpus in the mixture. `path` is a file, a glob, or several separated by commas."""

    name: str = ""  # "" -> "source<i>"; names key the loader state and the shard folders
    path: str = ""
    format: str = "auto"  # auto (from the extension) | jsonl | parquet | text (doc per line) | text_file
    text_field: str = "text"  # JSONL key / Parquet column holding the document
    weight: float = 1.0  # relative sampling weight, normalized over the sources


@dataclass
class SyntheticConfig:
    people: int = 1000
    docs_per_person: int = 4  # paraphrased biographies per person (helps knowledge extraction)
    seed: int = 0
    qa_fraction: float = 0.0  # people who also get QA-format training text (held-out phrasings stay unseen)
    qa_docs_per_person: int = 1  # QA documents per such person, each asking every fact in another phrasing


@dataclass
class FactsConfig:
    """kind=facts: the random-facts corpus (memlm.data.facts), N * A * log2(V) bits."""
    entities: int = 1000  # N invented entities
    attributes: int = 4  # A attributes each
    values: int = 256  # V candidate values per attribute, drawn uniformly
    seed: int = 0


@dataclass
class DataConfig:
    name: str = "random"
    seq_len: int = 128
    micro_batch: int = 4
    seed: int = 0
    kind: str = "random"
    sources: list[SourceConfig] = field(default_factory=list)
    shards_dir: str = ""  # kind=shards: output folder of memlm.data.prepare
    tokenizer: str = ""  # sentencepiece .model; shards: "" -> the one named in the manifest
    vocab_size: int = 512  # kind=random: token range; kind=synthetic: tokenizer size to train
    on_error: str = "raise"  # bad records: raise (naming file and line) | skip (counted, reported)
    val_fraction: float = 0.0  # raw/synthetic: documents held out by hash for split="val"
    shuffle: bool = True  # reshuffle documents every epoch (seeded); False keeps file order
    rows: str = "packed"  # one of ROWS (above)
    prefetch: int = 2  # batches prepared ahead in a background thread; 0 -> none
    num_workers: int = 1  # processes tokenizing raw/synthetic sources when the loader is built
    cache_dir: str = "data_cache"  # kind=synthetic/facts: where the corpus and tokenizer are written
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    facts: FactsConfig = field(default_factory=FactsConfig)

    def source_names(self) -> list[str]:
        return [s.name or f"source{i}" for i, s in enumerate(self.sources)]

    def validate(self, prefix: str = "data") -> None:
        for key in ("seq_len", "micro_batch", "num_workers"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "a positive integer")
        if self.kind not in KINDS:
            raise ConfigError(f"{prefix}.kind", self.kind, f"one of: {', '.join(KINDS)}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"{prefix}.on_error", self.on_error, f"one of: {', '.join(ON_ERROR)}")
        if self.rows not in ROWS:
            raise ConfigError(f"{prefix}.rows", self.rows, f"one of: {', '.join(ROWS)}")
        if self.rows == "documents" and self.kind == "random":
            raise ConfigError(f"{prefix}.rows", self.rows, f"packed with {prefix}.kind=random (random tokens have "
                              "no documents), or a data kind with documents")
        if self.prefetch < 0:
            raise ConfigError(f"{prefix}.prefetch", self.prefetch, "an integer >= 0 (0 disables prefetch)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"{prefix}.val_fraction", self.val_fraction, "a number in [0, 1)")
        if not 0 < self.vocab_size <= 2**31 - 1:
            raise ConfigError(f"{prefix}.vocab_size", self.vocab_size, "a positive integer below 2**31")
        self._validate_sources(prefix)
        self._check_read_by_kind(prefix)
        if self.kind == "raw" and not self.tokenizer:
            raise ConfigError(f"{prefix}.tokenizer", self.tokenizer, "the path of a sentencepiece .model (kind=raw)")
        if self.kind == "shards" and not self.shards_dir:
            raise ConfigError(f"{prefix}.shards_dir", self.shards_dir,
                              "the output folder of memlm.data.prepare (kind=shards)")
        if self.kind == "synthetic":
            if self.synthetic.people <= 0 or self.synthetic.docs_per_person <= 0:
                raise ConfigError(f"{prefix}.synthetic", self.synthetic, "people and docs_per_person > 0")
            if not 0.0 <= self.synthetic.qa_fraction <= 1.0:
                raise ConfigError(f"{prefix}.synthetic.qa_fraction", self.synthetic.qa_fraction, "a fraction in [0, 1]")
            from memlm.data.synthetic import MAX_QA_DOCS

            if not 1 <= self.synthetic.qa_docs_per_person <= MAX_QA_DOCS:
                raise ConfigError(f"{prefix}.synthetic.qa_docs_per_person", self.synthetic.qa_docs_per_person,
                                  f"an integer in [1, {MAX_QA_DOCS}] (the training phrasings per attribute)")
        if self.kind == "facts":
            from memlm.data.facts import check_sizes

            check_sizes(self.facts.entities, self.facts.attributes, self.facts.values, f"{prefix}.facts")
        if self.kind in ("synthetic", "facts") and not self.tokenizer and self.vocab_size < MIN_SPM_VOCAB:
            raise ConfigError(
                f"{prefix}.vocab_size", self.vocab_size,
                f"at least {MIN_SPM_VOCAB} to train a byte-fallback tokenizer (256 byte pieces + merges)",
            )

    def _check_read_by_kind(self, prefix: str) -> None:
        """A field set away from its default that this kind never reads is a
        mistake (a preset chosen over the override, a typo in data=...): refuse
        it rather than train on something else than the user asked for."""
        default = DataConfig()
        for key, kinds in READ_BY:
            if self.kind not in kinds and getattr(self, key) != getattr(default, key):
                raise ConfigError(f"{prefix}.{key}", getattr(self, key),
                                  f"left unset with {prefix}.kind={self.kind}, which does not read it "
                                  f"(read with {prefix}.kind={' or '.join(kinds)})")

    def _validate_sources(self, prefix: str) -> None:
        if self.kind == "raw" and not self.sources:
            raise ConfigError(f"{prefix}.sources", [], "a non-empty list of {name, path, format, text_field, weight}")
        names = self.source_names()
        for i, src in enumerate(self.sources):
            key = f"{prefix}.sources[{i}]"
            if self.kind == "raw" and not src.path:
                raise ConfigError(f"{key}.path", src.path, "a file path or glob")
            if src.format not in FORMATS:
                raise ConfigError(f"{key}.format", src.format, f"one of: {', '.join(FORMATS)}")
            if not src.weight > 0:
                raise ConfigError(f"{key}.weight", src.weight, "a positive number")
            if not src.text_field:
                raise ConfigError(f"{key}.text_field", src.text_field, "a non-empty field/column name")
            if names.count(names[i]) > 1:
                raise ConfigError(f"{key}.name", names[i], "a name not used by another source")
