"""The README demo: corpus -> tokenizer -> shards -> Memory+ pretraining ->
checkpoint -> factual QA and perplexity -> export, on CPU in a few minutes.

    python -m memlm.launch.demo [hydra overrides, e.g. steps=200]

Composes `experiment=demo` (configs/experiment/demo.yaml) plus your
overrides, prints a progress line at every stage, and ends with a results
table and where everything was written.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from memlm.data.config import SourceConfig
from memlm.data.corpus import materialize_synthetic
from memlm.data.prepare import prepare
from memlm.errors import ConfigError
from memlm.train.config import compose
from memlm.train.export import export
from memlm.train.trainer import Trainer


def stage(i: int, text: str) -> None:
    print(f"\n[demo {i}/4] {text}", flush=True)


def results_table(summary: dict, counts: dict, paths: dict[str, Path], seconds: float) -> str:
    rows = [("parameters (total / active)", f"{counts['total']:,} / {counts['active']:,}"),
            ("memory parameters", f"{counts['memory']:,}"),
            ("tokens trained", f"{summary['tokens']:,}"),
            ("final train loss", f"{summary['final_loss']:.3f}")]
    if summary.get("val_loss") is not None:
        rows.append(("validation perplexity", f"{math.exp(summary['val_loss']):.2f}"))
    for task, metrics in summary.get("evals", {}).items():
        for key in ("exact_match", "f1"):
            if key in metrics:
                rows.append((f"{task} {key} (n={metrics.get('n', '?')})", f"{100 * metrics[key]:.1f}%"))
    rows.append(("wall time", f"{seconds / 60:.1f} min"))
    rows += [(name, str(path)) for name, path in paths.items()]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k.ljust(width)} | {v}" for k, v in rows), line])


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    overrides = ["experiment=demo", *(sys.argv[1:] if argv is None else argv)]
    try:
        cfg = compose(overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # a tiny model: more threads only add synchronization
    dump = Path(cfg.dump_dir)
    if dump.exists():  # each demo is a fresh run (the corpus cache is kept)
        print(f"[demo] removing the previous demo run {dump}")
        shutil.rmtree(dump)

    syn = cfg.data.synthetic
    qa_text = (f", Q/A text in {syn.qa_docs_per_person} phrasings for {syn.qa_fraction:.0%} of them"
               if syn.qa_fraction > 0 else "")
    stage(1, f"synthetic factual corpus: {syn.people} people, {syn.docs_per_person} biographies each"
             f"{qa_text}, and its tokenizer")
    corpus = materialize_synthetic(cfg.data)
    print(f"  corpus {corpus['train']}\n  questions {corpus['qa']}\n  tokenizer {corpus['tokenizer']}")

    stage(2, "tokenizing into shards (2 processes, 2% of documents held out for validation)")
    shards = dump / "shards"
    manifest = prepare([SourceConfig(name="bios", path=corpus["train"])], corpus["tokenizer"], str(shards),
                       workers=2, val_fraction=0.02)
    src = manifest["sources"]["bios"]
    print(f"  {shards}: train {src['tokens']['train']:,} tokens / {src['docs']['train']:,} documents, "
          f"validation {src['tokens']['val']:,} tokens / {src['docs']['val']:,} documents")

    stage(3, f"pretraining a Memory+ model for {cfg.steps} steps (checkpoints every {cfg.checkpoint.every}), "
             f"then factual QA ({', '.join(cfg.eval.tasks)}) and validation perplexity")
    data = dataclasses.replace(cfg.data, kind="shards", shards_dir=str(shards), tokenizer=corpus["tokenizer"])
    cfg = dataclasses.replace(cfg, data=data)
    cfg.validate()
    trainer = Trainer(cfg)
    counts = trainer.model.num_params()
    summary = trainer.fit()

    stage(4, "exporting the final checkpoint to safetensors")
    out = export(dump, Path("exports") / cfg.name)
    paths = {"run directory": dump, "checkpoints": dump / "checkpoints", "metrics": dump / "metrics.jsonl",
             "eval results": dump / "evals", "export": out}
    print("\n" + results_table(summary, counts, paths, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
