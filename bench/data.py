"""Benchmark: the data pipeline on this machine (about 1-2 minutes on 2 cores).

    python bench/data.py             # full run, writes docs/benchmarks.md
    python bench/data.py --quick     # smaller corpus, a smoke run

1. Preparation throughput (tokens/s): the synthetic biography corpus tokenized
   into shards with 1 process (the baseline) and with N processes; the ratio.
2. Loader throughput (tokens/s) from those shards, seq_len 2048 x micro_batch 8,
   with the process pinned to ONE core, without and with the background
   prefetch thread. Biographies are short (~100 tokens), so each 16K-token batch
   packs ~160 documents: a pessimistic case for packing (goal >= 10M tokens/s).
Writes the table into docs/benchmarks.md under "## Data pipeline (bench/data.py)"
(other sections are kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import DOC, cpu_model, write_section  # noqa: E402

from memlm.data.config import DataConfig, SourceConfig
from memlm.data.prepare import prepare
from memlm.data.synthetic import write_corpus
from memlm.data.tokenizer import train_tokenizer

SECTION = "## Data pipeline (bench/data.py)"
SEQ_LEN, MICRO_BATCH, GOAL = 2048, 8, 10e6



def bench_prepare(root: Path, tokenizer: str, workers: int) -> dict:
    source = [SourceConfig(name="bios", path=str(root / "corpus" / "train.jsonl"))]
    before = os.times()
    # 2 MB units: enough pieces to keep every worker busy on a ~20 MB corpus.
    manifest = prepare(source, tokenizer, str(root / f"shards-{workers}"), workers=workers,
                       val_fraction=0.0, chunk_bytes=2 << 20, show_progress=False)
    after = os.times()
    # CPU seconds of this process and its (finished) workers: shows the work itself scales even
    # when other jobs leave fewer free cores than workers.
    cpu = sum(after[i] - before[i] for i in range(4))
    run = manifest["_run"]
    return {"workers": workers, "seconds": run["seconds"], "tokens": run["tokens"], "cpu": cpu,
            "tok_s": run["tokens"] / run["seconds"], "units": run["tokenized_units"]}


def bench_loader(shards: Path, prefetch: int, seconds: float) -> float:
    from memlm.data.loader import build_loader

    cfg = DataConfig(kind="shards", shards_dir=str(shards), seq_len=SEQ_LEN, micro_batch=MICRO_BATCH,
                     prefetch=prefetch)
    loader = build_loader(cfg)
    for _ in range(5):  # warm-up: page cache, epoch permutation
        next(loader)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        inputs, _ = next(loader)
        tokens += inputs.numel()
    return tokens / (time.perf_counter() - start)


def render(prep: list[dict], loader: dict, docs: int, tok_vocab: int, load: tuple[str, str], quick: bool) -> str:
    import torch

    base = prep[0]["tok_s"]
    best = max(loader.values())
    lines = [
        SECTION, "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"{datetime.date.today().isoformat()}{' (quick run)' if quick else ''}. "
        f"Load average before/after: {load[0]} / {load[1]} (the cores are shared with other jobs, "
        "so figures are noisy; ratios come from one run).", "",
        f"Corpus: synthetic biographies, {docs:,} documents, {prep[0]['tokens']:,} tokens "
        f"(byte-fallback BPE, vocab {tok_vocab}).", "",
        "| preparation | seconds | tokens/s | vs 1 process | CPU seconds |", "|---|---|---|---|---|",
    ]
    for row in prep:
        lines.append(f"| {row['workers']} process{'es' if row['workers'] > 1 else ''} ({row['units']} units) "
                     f"| {row['seconds']:.1f} | {row['tok_s'] / 1e6:.2f}M | {row['tok_s'] / base:.2f}x "
                     f"| {row['cpu']:.1f} |")
    lines += ["", f"| loader, one core, seq_len {SEQ_LEN} x micro_batch {MICRO_BATCH} | tokens/s |", "|---|---|"]
    for name, rate in loader.items():
        lines.append(f"| {name} | {rate / 1e6:.1f}M |")
    lines += [
        "",
        f"- Loader: {best / 1e6:.1f}M tokens/s on one core (goal >= {GOAL / 1e6:.0f}M: "
        f"{'met' if best >= GOAL else 'not met'}). With prefetch the batch is built in a thread that "
        "shares the core and the GIL with this do-nothing consumer; in training the consumer spends "
        "its time in torch kernels, which release the GIL, so the thread can overlap with them.",
        f"- Preparation with {prep[-1]['workers']} processes: {prep[-1]['tok_s'] / base:.2f}x one process "
        f"(wall clock, including worker start-up). CPU seconds were {prep[-1]['cpu'] / prep[0]['cpu']:.2f}x "
        "those of one process (the extra is worker start-up) and the run kept "
        f"{prep[-1]['cpu'] / prep[-1]['seconds']:.2f} cores busy: with fewer free cores than workers "
        "(other jobs; see the load average) the ratio stays below the process count.",
        "",
    ]
    return "\n".join(lines)



def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small corpus, short loader runs (smoke run)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes of the parallel run")
    parser.add_argument("--seconds", type=float, default=5.0, help="loader measurement time per setting")
    parser.add_argument("--no-write", action="store_true", help=f"print only, do not update {DOC.name}")
    args = parser.parse_args(argv)
    people, seconds = (2000, 1.0) if args.quick else (15000, args.seconds)
    load_before = f"{os.getloadavg()[0]:.2f}"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_corpus(str(root / "corpus"), people, docs_per_person=4, seed=0)
        with open(paths["train"]) as fh:
            docs = [json.loads(line)["text"] for line in fh]
        tok = train_tokenizer(docs, str(root / "tok.model"), vocab_size=4096, input_sentence_size=200_000,
                              hard_vocab_limit=False)
        print(f"corpus: {len(docs):,} documents, tokenizer vocab {tok.vocab_size}", flush=True)
        prep = []
        for workers in sorted({1, args.workers}):
            prep.append(bench_prepare(root, tok.path, workers))
            print(f"prepare, {workers} process(es): {prep[-1]['tok_s'] / 1e6:.2f}M tokens/s "
                  f"({prep[-1]['seconds']:.1f} s)", flush=True)
        if len(prep) > 1:
            print(f"ratio {prep[-1]['workers']} processes / 1: {prep[-1]['tok_s'] / prep[0]['tok_s']:.2f}x")
        affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(affinity)})  # the loader figure is for ONE core
        import torch  # imported late: preparation workers re-import this file (spawn) and need no torch

        torch.set_num_threads(1)
        try:
            loader = {}
            for prefetch in (0, 2):
                name = "no prefetch" if prefetch == 0 else f"prefetch {prefetch} (background thread)"
                loader[name] = bench_loader(root / "shards-1", prefetch, seconds)
                print(f"loader, {name}: {loader[name] / 1e6:.1f}M tokens/s", flush=True)
        finally:
            os.sched_setaffinity(0, affinity)
    text = render(prep, loader, len(docs), tok.vocab_size, (load_before, f"{os.getloadavg()[0]:.2f}"), args.quick)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
        print(f"wrote {DOC}")
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
