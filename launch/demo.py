"""The README demo: corpus -> tokenizer -> shards -> Memory+ pretraining ->
checkpoint -> factual QA and perplexity -> export, on CPU in a few minutes.

    python -m memlm.launch.demo [hydra overrides, e.g. steps=200]

Composes `experiment=demo` (configs/experiment/demo.yaml) plus your
overrides, prints a progress line at every stage, and ends with a results
table and where everything was written.

Each demo is a fresh run, so a second `demo` replaces the first: but only
folders the demo itself made, holding nothing but what it wrote. It marks its
run folder with `.memlm-demo`, which names the export it writes and, once the
demo finished, lists every file of the run folder with its crc32. A run
folder or an export without that mark, one holding a file the demo did not
write or changed since (a later `memlm.evals` result, a note of yours), or
the folder of a demo that did not finish, is refused with one line (exit 2),
and nothing is touched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from memlm.checkpoint.run_lock import RunLock, RunLockedError
from memlm.config.run import compose
from memlm.data.config import SourceConfig, SyntheticConfig
from memlm.data.corpus import materialize_synthetic
from memlm.data.prepare import prepare
from memlm.distributed.env import ProcessGroup
from memlm.errors import entry_point
from memlm.files import RUN_LOCK, OutputError, changed_files, folder_manifest, foreign_files, listing
from memlm.hf.pretrained import MANIFEST_NAME, ExportError, read_manifest
from memlm.run.export import export
from memlm.train.trainer import Trainer


def stage(i: int, text: str) -> None:
    print(f"\n[demo {i}/4] {text}", flush=True)


# The demo's QA tasks as the README names them.
TASK_LABELS = {"synthetic_qa_trained": "facts, trained phrasing", "synthetic_qa_seen": "facts, held-out phrasings"}


def results_table(summary: dict, counts: dict, paths: dict[str, Path], seconds: float) -> str:
    rows = [("parameters (total / active)", f"{counts['total']:,} / {counts['active']:,}"),
            ("memory parameters", f"{counts['memory']:,}"),
            ("tokens trained", f"{summary['tokens']:,}"),
            ("final train loss", f"{summary['final_loss']:.3f}")]
    if summary.get("val_loss") is not None:
        rows.append(("validation perplexity", f"{math.exp(summary['val_loss']):.2f}"))
    for task, metrics in summary.get("evals", {}).items():
        what = TASK_LABELS.get(task, task)
        for key in ("exact_match", "f1"):
            if key in metrics:
                rows.append((f"{what}: {key} (n={metrics.get('n', '?')})", f"{100 * metrics[key]:.1f}%"))
    rows.append(("wall time", f"{seconds / 60:.1f} min"))
    rows += [(name, str(path)) for name, path in paths.items()]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k.ljust(width)} | {v}" for k, v in rows), line])


MARK = ".memlm-demo"


class DemoFolderError(OutputError):
    """A folder the demo would replace holds something the demo did not make."""


def claim_folders(dump: Path, export_dir: Path) -> None:
    """Make room for a fresh demo in `dump` and `export_dir`: remove them only
    when the demo made them (its mark), refuse anything else untouched."""
    mark = dump / MARK
    made = json.loads(mark.read_text()) if mark.is_file() else None
    if dump.exists() and made is None and any(dump.iterdir()):
        raise DemoFolderError(
            f"{dump} exists and was not made by the demo (no {MARK} in it), so it is left alone: "
            f"choose another demo name (name=...) or move that folder away")
    ours = made is not None and Path(made.get("export", "")).resolve() == export_dir.resolve()
    if export_dir.exists() and not ours and any(export_dir.iterdir()):
        raise DemoFolderError(
            f"{export_dir} exists and was not written by the demo run {dump}, so it is left alone: "
            f"choose another demo name (name=...) or move that folder away")
    if made is not None:
        try:  # a demo still running there keeps its folder
            RunLock.acquire(dump).release()
        except RunLockedError as err:
            raise DemoFolderError(str(err)) from None
        check_only_demo_files(dump, made, export_dir if ours else None)
        print(f"[demo] replacing the previous demo run {dump}" + (f" and its export {export_dir}" if ours else ""))
        shutil.rmtree(dump)
        if ours:
            shutil.rmtree(export_dir, ignore_errors=True)
    dump.mkdir(parents=True, exist_ok=True)
    mark.write_text(json.dumps({"export": str(export_dir)}) + "\n")


def mark_finished(dump: Path, export_dir: Path) -> None:
    """Record in the mark every file the finished demo wrote in `dump` (its export has its own manifest)."""
    files = folder_manifest(dump, exclude=[MARK, RUN_LOCK])
    (dump / MARK).write_text(json.dumps({"export": str(export_dir), "files": files}) + "\n")


def check_only_demo_files(dump: Path, made: dict, export_dir: Path | None) -> None:
    """A previous demo's folders hold only what it wrote (its mark's files; its export's manifest):
    else DemoFolderError naming the others, or the folder of a demo that did not finish."""
    if not isinstance(made.get("files"), dict):
        raise DemoFolderError(f"{dump} holds a demo run that did not finish (its {MARK} lists no files), so "
                              "memlm cannot tell the demo's files from yours and leaves it alone: move or delete "
                              "it yourself, or choose another demo name (name=...)")
    known = {**made["files"], MARK: None, RUN_LOCK: None}  # the lock file changes with each holder: memlm's
    others = [str(dump / n) for n in foreign_files(dump, known) + changed_files(dump, made["files"])]
    if export_dir is not None and export_dir.exists():
        try:
            written = read_manifest(export_dir)
            others += [str(export_dir / n) for n in foreign_files(export_dir, written, [MANIFEST_NAME])
                       + changed_files(export_dir, written)]
        except ExportError as err:
            others.append(f"{export_dir} ({err})")
    if others:
        raise DemoFolderError(f"the previous demo's folders hold files it did not write, or changed since: "
                              f"{listing(others)}; they are left alone: move them away, or choose another demo "
                              "name (name=...)")


@entry_point
def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    overrides = ["experiment=demo", *(sys.argv[1:] if argv is None else argv)]
    cfg = compose(overrides)
    torch.set_num_threads(1)  # a tiny model: more threads only add synchronization
    dump, export_dir = Path(cfg.dump_dir), Path("exports") / cfg.name
    claim_folders(dump, export_dir)  # each demo is a fresh run (the corpus cache is kept)

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
    # The run reads the shards (their manifest names the corpus the QA tasks ask about).
    data = dataclasses.replace(cfg.data, kind="shards", shards_dir=str(shards), tokenizer=corpus["tokenizer"],
                               synthetic=SyntheticConfig())
    cfg = dataclasses.replace(cfg, data=data)
    cfg.validate()
    with ProcessGroup(cfg.device):  # one process: no group, but the trainer is freed the way a run's is
        trainer = Trainer(cfg)
        counts = trainer.model.num_params()
        summary = trainer.fit()
        del trainer

    stage(4, "exporting the final checkpoint to safetensors")
    out = export(dump, export_dir)
    mark_finished(dump, export_dir)
    paths = {"run directory": dump, "checkpoints": dump / "checkpoints", "metrics": dump / "metrics.jsonl",
             "eval results": dump / "evals", "export": out}
    print("\n" + results_table(summary, counts, paths, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
