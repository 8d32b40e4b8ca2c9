"""The CUDA paths the other device-check sections never take (bench/device_check.sh, section `paths`).

    python bench/device_train.py paths --json OUT/paths.json
    python bench/device_train.py paths --dry-run        # the same on CPU: checks the plumbing

The mfu, nosync and compile sections train on random tokens with the
defaults; a user's run also masks documents, evaluates, saves, fine-tunes
and generates. The first device check (docs/benchmarks.md, "Device check")
found three crashes in such CUDA-only branches, so each branch gets a few
real steps here: the random-facts corpus (memlm.data.facts, made offline,
as the capacity study trains on), a dim-64 model, on the GPU in bf16.

    doc_mask      Memory+ with model.doc_mask=true (FlexAttention on CUDA), a checkpoint
                  with the last steps' slot usage, then the facts_bits eval after training
    kernel_torch  memory.kernel=torch: the read's PyTorch path (Triton is CUDA's default)
    sparse        memory.sparse_updates=true: sparse value gradients, row-wise AdamW
    peer          memory=peer (row_dots on CUDA)
    engram        Engram's tables on the device (memory=engram, row-wise AdamW)
    engram_host   the same with the tables in host memory (memory.engram.tables_in=host): pinned
                  staging, non-blocking copies both ways, the row updates on the host
    finetune      finetune=sparse from doc_mask's checkpoint and its slot usage
    generate      greedy decoding from that checkpoint (memlm.generate)

A path passes when it raises nothing and its last logged loss is finite. It
prints `PARTIAL paths <name>: ...` as each ends; bench/device_train.py
prints the `RESULT paths ok|FAIL` line. A failed path is named and the next
still runs.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from pathlib import Path

import torch

from memlm.config.run import compose
from memlm.train.trainer import Trainer

FACTS = ["data.facts.entities=200", "steps=8", "logging.every=4", "optim.warmup=2", "checkpoint.at_end=false",
         "eval.after_training=false"]
# Each path: its experiment, then overrides on FACTS (the finetune path adds init_from).
PATHS = {
    "doc_mask": ["experiment=capacity_memplus", "model.doc_mask=true", "checkpoint.at_end=true",
                 "checkpoint.slot_usage_steps=2", "eval.after_training=true"],
    "kernel_torch": ["experiment=capacity_memplus", "memory.kernel=torch"],
    "sparse": ["experiment=capacity_memplus", "memory.sparse_updates=true"],
    "peer": ["experiment=capacity_peer"],
    "engram": ["experiment=capacity_engram", "memory.sparse_updates=true"],
    "engram_host": ["experiment=capacity_engram", "memory.sparse_updates=true", "memory.engram.tables_in=host"],
    "finetune": ["experiment=capacity_memplus", "finetune=sparse", "finetune.top_t=64"],
}


def _overrides(name: str, dry: bool, tmp: str) -> list[str]:
    experiment, *extra = PATHS[name]
    # A dry run only checks the plumbing: 4 steps of 4 sequences.
    device = ["device=cpu", "parallel.dtype=fp32", "steps=4", "logging.every=2", "data.micro_batch=4"] if dry \
        else ["parallel.dtype=bf16"]
    return [experiment, *FACTS, *extra, *device, f"data.cache_dir={tmp}/cache", f"dump_dir={tmp}/{name}"]


def train_path(name: str, dry: bool, tmp: str, init_from: str | None = None) -> dict:
    overrides = _overrides(name, dry, tmp) + ([f"init_from={init_from}"] if init_from else [])
    summary = Trainer(compose(overrides)).fit()
    loss = summary.get("final_loss")
    loss = float("nan") if loss is None else loss
    return {"loss": loss, "steps": summary.get("steps"), "ok": math.isfinite(loss), "evals": summary.get("evals")}


def generate_path(checkpoint: str, dry: bool) -> dict:
    from memlm.generate import generate, load

    model, tokenizer = load(checkpoint, device="cpu" if dry else "cuda")
    done = generate(model, tokenizer, ["The", "A"], max_new_tokens=8)
    return {"texts": [c.text for c in done], "ok": len(done) == 2}


def section_paths(dry: bool, tmp: str) -> dict:
    results: dict[str, dict] = {}

    def attempt(name, fn):
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as err:  # noqa: BLE001 - a failed path is recorded, the next still runs
            traceback.print_exc()
            first_line = str(err).splitlines()[0] if str(err) else ""
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {first_line}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"PARTIAL paths {name}: {json.dumps(results[name], default=str)}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    for name in ("doc_mask", "kernel_torch", "sparse", "peer", "engram", "engram_host"):
        attempt(name, lambda n=name: train_path(n, dry, tmp))
    checkpoints = sorted((Path(tmp) / "doc_mask" / "checkpoints").glob("step_*"))
    if checkpoints:
        attempt("finetune", lambda: train_path("finetune", dry, tmp, init_from=str(checkpoints[-1])))
        attempt("generate", lambda: generate_path(str(checkpoints[-1]), dry))
    else:
        results["finetune"] = results["generate"] = {"ok": False, "error": "doc_mask left no checkpoint"}
    failed = [f"{k}: {v.get('error') or 'loss ' + str(v.get('loss'))}" for k, v in results.items() if not v["ok"]]
    line = "; ".join(failed) if failed else ", ".join(f"{k} {v['seconds']:.0f}s" for k, v in results.items())
    return {"ok": not failed, "line": f"{len(failed)} of {len(results)} paths failed: {line}" if failed
            else f"{len(results)} paths ran: {line}", "results": results}
