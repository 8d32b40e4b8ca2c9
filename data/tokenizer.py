"""The sentencepiece tokenizer: training from sources, loading, batch encode/decode.

    python -m memlm.data.tokenizer train --input 'corpus/*.jsonl.zst' --vocab-size 32000 --out tok.model
    python -m memlm.data.tokenizer info tok.model

`train` writes --out only when it is a new file, or a sentencepiece model with
--overwrite; never one of its --input files (memlm.files.check_output_file).

Models are BPE with byte fallback (any Unicode text round-trips: characters
outside the vocabulary become UTF-8 byte pieces), identity normalization and
no whitespace folding, so `decode(encode(text)) == text`. Special ids are fixed:
unk=0, bos=1, eos=2, pad=3. A model's identity is the sha256 of its file
(`Tokenizer.sha256`); it is stored with every shard set and checked on load.

Large inputs are sampled to `input_sentence_size` lines by a seeded reservoir
sampler here rather than by sentencepiece's own sampler, whose choice is not
reproducible between runs; with a fixed `num_threads` training is deterministic.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import os
import random
import re
import sys
from collections.abc import Iterable, Iterator

import sentencepiece as spm
from tqdm import tqdm

from memlm.errors import ConfigError, entry_point
from memlm.files import atomic_write_bytes, check_output_file, check_output_path

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# sentencepiece skips longer training lines; documents are fed line by line anyway.
MAX_SENTENCE_BYTES = 16384
MIN_VOCAB = 260  # 256 byte pieces + the 4 special ids
# How train_tokenizer's errors name its settings unless the caller names them its own way.
DEFAULT_KEYS = {"vocab_size": "vocab_size", "character_coverage": "character_coverage", "input": "docs",
                "input_value": "(the documents given)"}


class Tokenizer:
    """A loaded sentencepiece model plus its content hash."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ConfigError("tokenizer", path, "the path of an existing sentencepiece .model file")
        with open(path, "rb") as fh:
            proto = fh.read()
        self.path = path
        self.sha256 = hashlib.sha256(proto).hexdigest()
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=proto)
        except RuntimeError as err:  # sentencepiece's parse failure names no file
            raise ConfigError("tokenizer", path, f"a sentencepiece .model file; this one cannot be parsed "
                              f"({len(proto)} bytes: {' '.join(str(err).split())})") from None
        if self.sp.vocab_size() == 0:  # e.g. an empty file parses as an empty model
            raise ConfigError("tokenizer", path,
                              f"a sentencepiece .model file; this one holds no pieces ({len(proto)} bytes)")

    @property
    def vocab_size(self) -> int:
        return self.sp.vocab_size()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self.sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(list(map(int, ids)))

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        # num_threads=1: preparation already runs one process per core.
        return self.sp.encode(texts, num_threads=num_threads)

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def info(self) -> dict:
        return {"path": os.path.abspath(self.path), "sha256": self.sha256, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id}


def is_model_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a sentencepiece model file (one a tokenizer command may replace)."""
    try:
        Tokenizer(str(path))
    except ConfigError:
        return False
    return True


def sample_lines(docs: Iterable[str], size: int, shuffle: bool, seed: int) -> Iterator[str]:
    """Non-empty lines of the documents; at most `size` of them (seeded reservoir sample) when size > 0."""
    lines = (line for doc in docs for line in doc.split("\n") if line.strip())
    if size <= 0:
        yield from lines
        return
    rng = random.Random(seed)
    reservoir: list[str] = []
    for i, line in enumerate(lines):
        if len(reservoir) < size:
            reservoir.append(line)
        elif (j := rng.randrange(i + 1)) < size:
            reservoir[j] = line
    if shuffle:
        rng.shuffle(reservoir)
    yield from reservoir


def train_tokenizer(
    docs: Iterable[str],
    out: str,
    vocab_size: int = 32000,
    character_coverage: float = 0.9995,
    input_sentence_size: int = 2_000_000,
    shuffle: bool = True,
    seed: int = 0,
    num_threads: int = 1,
    hard_vocab_limit: bool = True,
    keys: dict[str, str] | None = None,
) -> Tokenizer:
    """Train a BPE byte-fallback model on the documents and write it atomically to `out` (.model).

    `keys` names the settings in the caller's words for its error lines (the CLI's `--vocab-size`,
    a run's `data.vocab_size`; "input": what the documents came from)."""
    keys = {**DEFAULT_KEYS, **(keys or {})}
    if vocab_size < MIN_VOCAB:
        raise ConfigError(keys["vocab_size"], vocab_size, f"at least {MIN_VOCAB} (256 byte pieces + 4 special tokens)")
    if not 0 < character_coverage <= 1:
        raise ConfigError(keys["character_coverage"], character_coverage, "a number in (0, 1]")
    lines = sample_lines(docs, input_sentence_size, shuffle, seed)
    first = next(lines, None)
    if first is None:  # sentencepiece would fail on an empty sentence list with its own traceback
        raise ConfigError(keys["input"], keys["input_value"], "documents with text to train a tokenizer on: every "
                          "line read is empty or whitespace only")
    buf = io.BytesIO()
    try:
        _train(itertools.chain([first], lines), buf, vocab_size, character_coverage, hard_vocab_limit, num_threads)
    except RuntimeError as err:
        needed = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if needed is None:
            raise
        chars = int(needed.group(2)) - MIN_VOCAB  # sentencepiece counts the byte and special pieces too
        coverage = keys["character_coverage"]  # "": not a setting of the caller's
        kept = (f"the {chars} characters that {coverage}={character_coverage:g} keeps whole (or a lower {coverage})"
                if coverage else f"the text's {chars} distinct characters")
        raise ConfigError(keys["vocab_size"], vocab_size, f"at least {needed.group(2)} for this text: {MIN_VOCAB} "
                          f"byte and special pieces + {kept}") from None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_write_bytes(out, buf.getvalue())
    return Tokenizer(out)


def _train(lines: Iterator[str], buf: io.BytesIO, vocab_size: int, character_coverage: float,
           hard_vocab_limit: bool, num_threads: int) -> None:
    """sentencepiece's trainer with memlm's fixed settings (module docstring)."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=character_coverage,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        input_sentence_size=0,  # sampled above, reproducibly
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        hard_vocab_limit=hard_vocab_limit,
        num_threads=num_threads,
        minloglevel=2,
    )


@entry_point
def main(argv: list[str] | None = None) -> int:
    from memlm.data.sources import expand_paths, iter_documents
    from memlm.data.stats import SkipStats

    parser = argparse.ArgumentParser(prog="python -m memlm.data.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a BPE byte-fallback sentencepiece model")
    tr.add_argument("--input", action="append", required=True, help="file or glob (repeatable); .gz/.zst ok")
    tr.add_argument("--format", default="auto", help="auto | jsonl | parquet | text | text_file")
    tr.add_argument("--text-field", default="text", help="JSONL key / Parquet column with the text")
    tr.add_argument("--out", required=True, help="output .model path")
    tr.add_argument("--overwrite", action="store_true",
                    help="replace --out when it is a sentencepiece model (any other file is never replaced)")
    tr.add_argument("--vocab-size", type=int, default=32000)
    tr.add_argument("--character-coverage", type=float, default=0.9995)
    tr.add_argument("--input-sentence-size", type=int, default=2_000_000, help="lines sampled; 0 = all")
    tr.add_argument("--no-shuffle", action="store_true", help="keep sampled lines in input order")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="training threads (changes the result)")
    tr.add_argument("--on-error", default="raise", choices=["raise", "skip"])
    info = sub.add_parser("info", help="print vocab size, special ids and hash of a model")
    info.add_argument("model")
    args = parser.parse_args(argv)

    if args.command == "info":
        for key, value in Tokenizer(args.model).info().items():
            print(f"{key}: {value}")
        return 0
    paths = [p for pattern in args.input for p in expand_paths(pattern, "--input")]
    check_output_path(args.out, {path: "one of its --input files" for path in paths})
    check_output_file(args.out, "sentencepiece model", is_model_file, "--overwrite", args.overwrite)
    stats = SkipStats()
    with tqdm(iter_documents(paths, args.format, args.text_field, args.on_error, stats),
              desc="reading documents", unit="doc", file=sys.stderr) as docs:  # closed before an error line
        tok = train_tokenizer(docs, args.out, args.vocab_size, args.character_coverage, args.input_sentence_size,
                              not args.no_shuffle, args.seed, args.threads,
                              keys={"vocab_size": "--vocab-size", "character_coverage": "--character-coverage",
                                    "input": "--input", "input_value": " ".join(args.input)})
    print(f"trained {tok.path}: vocab {tok.vocab_size}, sha256 {tok.sha256[:16]}..., "
          f"from {len(paths)} files: {stats.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
