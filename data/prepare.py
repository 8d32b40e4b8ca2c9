"""Tokenize sources into memory-mappable shards (layout: memlm.data.shards).

    python -m memlm.data.prepare --source web='raw/web/*.jsonl.zst' --source code='raw/code/*.parquet' \\
        --tokenizer tok.model --out shards/ --workers 8 --val-fraction 0.005
    python -m memlm.data.prepare --config configs/data/mycorpus.yaml --workers 8

Each source's files are cut into work units (memlm.data.sources) that worker
processes tokenize and write as shards. Re-running the same command resumes:
units whose shards are complete for the same input and tokenizer are skipped;
the manifest is rewritten atomically at the end. Documents go to the `val`
split when their hash falls in the first `--val-fraction` of the hash range,
so the held-out set does not depend on file order or worker count.

The output folder may hold other files (they are never touched), but it is
no memlm run folder, and a manifest.json already there must be an earlier
prepare's; anything else is refused with one line before anything is written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from datetime import datetime, timezone

from tqdm import tqdm

from memlm.data.config import DataConfig, SourceConfig
from memlm.data.encode import encode_unit
from memlm.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_KEYS,
    SPLITS,
    token_dtype,
    write_json,
    write_shard,
)
from memlm.data.sources import WorkUnit, expand_paths, plan_units
from memlm.data.stats import SkipStats
from memlm.data.tokenizer import Tokenizer
from memlm.errors import ConfigError, entry_point
from memlm.files import OutputError, check_output_file, check_output_path

DEFAULT_CHUNK_MB = 64


def _done_path(out_dir: str, unit: WorkUnit) -> str:
    return os.path.join(out_dir, unit.source, f"unit-{unit.index:05d}.json")


def _expected(unit: WorkUnit, tok: Tokenizer, val_fraction: float) -> dict:
    dtype = token_dtype(tok.vocab_size).name
    return {"spec": unit.spec(), "tokenizer_sha256": tok.sha256, "val_fraction": val_fraction, "dtype": dtype}


def _finished(out_dir: str, unit: WorkUnit, expected: dict) -> dict | None:
    """The unit's record when its shards are complete for this exact input and tokenizer."""
    try:
        with open(_done_path(out_dir, unit)) as fh:
            record = json.load(fh)
    except (OSError, ValueError):  # missing, unreadable or not JSON: the unit is redone
        return None
    if not isinstance(record, dict) or not isinstance(record.get("shards"), dict):
        return None
    if any(record.get(k) != v for k, v in expected.items()):
        return None
    folder = os.path.join(out_dir, unit.source)
    files = [e[k] for e in record["shards"].values() for k in ("bin", "index")]
    return record if all(os.path.isfile(os.path.join(folder, f)) for f in files) else None


def run_unit(unit: WorkUnit, tokenizer_path: str, on_error: str, val_fraction: float, out_dir: str,
             progress_queue=None) -> dict:
    """Tokenize one unit and write its shards; runs in a worker process. Returns the unit record."""
    tok = Tokenizer(tokenizer_path)
    expected = _expected(unit, tok, val_fraction)
    report = None if progress_queue is None else (lambda d, t: progress_queue.put((d, t)))
    encoded = encode_unit(unit, tok, on_error, val_fraction, token_dtype(tok.vocab_size), report)
    folder = os.path.join(out_dir, unit.source)
    shards = {
        split: write_shard(folder, f"{split}-{unit.index:05d}", tokens, offsets)
        for split, (tokens, offsets) in encoded.splits.items()
        if len(tokens)
    }
    record = {**expected, "shards": shards, "stats": encoded.stats.to_dict()}
    write_json(_done_path(out_dir, unit), record)  # last: marks the unit finished
    return record


def prepare(sources: list[SourceConfig], tokenizer_path: str, out_dir: str, workers: int = 1,
            val_fraction: float = 0.005, on_error: str = "raise", chunk_bytes: int = DEFAULT_CHUNK_MB << 20,
            show_progress: bool = True) -> dict:
    """Tokenize every source into shards under out_dir; return the manifest (also written to out_dir)."""
    cfg = DataConfig(kind="raw", sources=sources, tokenizer=tokenizer_path, on_error=on_error,
                     val_fraction=val_fraction, num_workers=workers)
    cfg.validate()
    if chunk_bytes <= 0:
        raise ConfigError("chunk_bytes", chunk_bytes, "a positive size (--chunk-mb > 0)")
    tok = Tokenizer(tokenizer_path)
    plans: dict[str, tuple[SourceConfig, list[WorkUnit]]] = {}
    for i, (name, src) in enumerate(zip(cfg.source_names(), sources)):
        paths = expand_paths(src.path, f"sources[{i}].path")
        plans[name] = (src, plan_units(name, paths, src.format, src.text_field, chunk_bytes))
    check_out_dir(out_dir)
    for name in plans:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    units = [u for _, us in plans.values() for u in us]
    records: dict[tuple[str, int], dict] = {}
    todo = []
    for unit in units:
        done = _finished(out_dir, unit, _expected(unit, tok, val_fraction))
        if done is None:
            todo.append(unit)
        else:
            records[(unit.source, unit.index)] = done
    start = time.perf_counter()
    args = (tokenizer_path, on_error, val_fraction, out_dir)
    # Closed on an error too: its line ends before the command's `error:` line.
    with tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not show_progress, file=sys.stderr) as bar:
        bar.set_postfix(units=f"{len(records)}/{len(units)}")
        if workers == 1 or len(todo) <= 1:
            for unit in todo:
                records[(unit.source, unit.index)] = run_unit(unit, *args, _BarQueue(bar))
                bar.set_postfix(units=f"{len(records)}/{len(units)}")
        else:
            _run_parallel(todo, args, workers, records, bar, len(units))
    manifest = _manifest(plans, records, tok, val_fraction)
    write_json(os.path.join(out_dir, MANIFEST), manifest)
    tokenized = sum(e["tokens"] for u in todo for e in records[(u.source, u.index)]["shards"].values())
    manifest["_run"] = {"seconds": time.perf_counter() - start, "tokenized_units": len(todo),
                        "reused_units": len(units) - len(todo), "tokens": tokenized}
    return manifest


def check_out_dir(out_dir: str) -> None:
    """out_dir is no run folder, is a folder if it exists, and its manifest.json, if any, is a
    shard manifest (an earlier prepare's, resumed): the one file of a generic name prepare
    replaces. Its other files (`<source>/unit-*`, `<source>/{train,val}-*`) are prepare's own."""
    check_output_path(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OutputError(f"{out_dir} is a file: name a folder for the shards")
    check_output_file(os.path.join(out_dir, MANIFEST), "shard manifest of memlm.data.prepare", _is_shard_manifest)


def _is_shard_manifest(path) -> bool:
    try:
        with open(path, "rb") as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and all(key in manifest for key in MANIFEST_KEYS)


class _BarQueue:
    """The progress queue interface, updating the bar directly (single-process run)."""

    def __init__(self, bar: tqdm):
        self.bar = bar

    def put(self, item: tuple[int, int]) -> None:
        self.bar.update(item[1])


def _run_parallel(todo: list[WorkUnit], args: tuple, workers: int, records: dict, bar: tqdm, n_units: int) -> None:
    # spawn: safe even when the caller has threads (torch, a test runner); workers only need numpy + spm.
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(min(workers, len(todo))) as pool:
        progress = manager.Queue()
        pending = {pool.apply_async(run_unit, (unit, *args, progress)): unit for unit in todo}
        while pending:
            try:
                while True:
                    bar.update(progress.get(timeout=0.2)[1])
            except queue.Empty:
                pass
            for job in [j for j in pending if j.ready()]:
                unit = pending.pop(job)
                records[(unit.source, unit.index)] = job.get()  # re-raises a worker's DataError here
                bar.set_postfix(units=f"{len(records)}/{n_units}")


def _manifest(plans: dict, records: dict, tok: Tokenizer, val_fraction: float) -> dict:
    sources = {}
    for name, (src, units) in plans.items():
        stats = SkipStats()
        shards: dict[str, list[dict]] = {s: [] for s in SPLITS}
        for unit in units:
            record = records[(name, unit.index)]
            stats.merge(SkipStats.from_dict(record["stats"]))
            for split, entry in record["shards"].items():
                shards[split].append(entry)
        sources[name] = {
            "path": src.path, "format": src.format, "text_field": src.text_field, "weight": src.weight,
            "shards": shards, "stats": stats.to_dict(),
            "tokens": {s: sum(e["tokens"] for e in shards[s]) for s in SPLITS},
            "docs": {s: sum(e["docs"] for e in shards[s]) for s in SPLITS},
        }
    return {"version": FORMAT_VERSION, "tokenizer": tok.info(), "dtype": token_dtype(tok.vocab_size).name,
            "val_fraction": val_fraction, "sources": sources,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _parse_source(text: str, fmt: str, text_field: str) -> SourceConfig:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError("--source", text, "NAME=GLOB, e.g. web='raw/web/*.jsonl.zst'")
    return SourceConfig(name=name, path=path, format=fmt, text_field=text_field)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", default=[], help="NAME=GLOB (repeatable)")
    parser.add_argument("--config", help="a data preset (YAML) whose sources/tokenizer/shards_dir to use")
    parser.add_argument("--tokenizer", help="sentencepiece .model (overrides the preset)")
    parser.add_argument("--out", help="output folder (overrides the preset's shards_dir)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--val-fraction", type=float, default=0.005, help="documents held out (by hash)")
    parser.add_argument("--format", default="auto", help="format of --source inputs: auto|jsonl|parquet|text|text_file")
    parser.add_argument("--text-field", default="text", help="JSONL key / Parquet column of --source inputs")
    parser.add_argument("--on-error", choices=["raise", "skip"], help="bad records: raise, or count and skip")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB, help="split larger files into units")
    args = parser.parse_args(argv)

    cfg = DataConfig()
    if args.config:
        from omegaconf import OmegaConf

        merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(args.config))
        cfg = OmegaConf.to_object(merged)
    sources = [_parse_source(s, args.format, args.text_field) for s in args.source] or cfg.sources
    tokenizer = args.tokenizer or cfg.tokenizer
    out = args.out or cfg.shards_dir
    if not tokenizer:
        raise ConfigError("--tokenizer", tokenizer,
                          "a sentencepiece .model (train one: python -m memlm.data.tokenizer train)")
    if not out:
        raise ConfigError("--out", out, "an output folder")
    manifest = prepare(sources, tokenizer, out, args.workers, args.val_fraction,
                       args.on_error or cfg.on_error, int(args.chunk_mb * (1 << 20)))
    run = manifest["_run"]
    print(f"prepared {out} in {run['seconds']:.1f}s: {run['tokenized_units']} units tokenized "
          f"({run['tokens'] / max(run['seconds'], 1e-9) / 1e6:.2f}M tok/s), {run['reused_units']} reused")
    for name, src in manifest["sources"].items():
        stats = SkipStats.from_dict(src["stats"])
        print(f"  {name}: train {src['tokens']['train']:,} tokens / {src['docs']['train']:,} docs, "
              f"val {src['tokens']['val']:,} tokens / {src['docs']['val']:,} docs; {stats.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
