"""`run_suite`: evaluate a loaded model on the configured tasks and write the report.

The contract is documented in memlm/evals/__init__.py; the command line
(`python -m memlm.evals`) and the trainer both end up here.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from memlm.config.eval import EvalConfig
from memlm.config.eval_tasks import known_tasks
from memlm.data.config import DataConfig
from memlm.errors import ConfigError
from memlm.evals.harness import evaluate_task
from memlm.evals.metrics import exact_match_by
from memlm.evals.report import log_wandb, markdown_table, write_report
from memlm.evals.tasks import load_task


def run_suite(
    model,
    tokenizer,
    eval_cfg: EvalConfig,
    step: int,
    out_dir: Path | str | None,
    rank: int = 0,
    world_size: int = 1,
    *,
    data_cfg: DataConfig | None = None,
    json_name: str | None = None,
    meta: dict | None = None,
) -> dict[str, dict]:
    eval_cfg.validate()
    if not eval_cfg.tasks:
        raise ConfigError("eval.tasks", [], f"a non-empty list of tasks, {known_tasks()}")
    start = time.perf_counter()
    # Every task's files are read and checked before the first forward pass: a
    # missing file fails now, not an hour into the suite.
    loaded = {name: load_task(name, eval_cfg, data_cfg) for name in eval_cfg.tasks}
    was_training = model.training
    model.eval()
    results: dict[str, dict] = {}
    tasks: dict[str, dict] = {}
    samples: dict[str, list[dict]] = {}
    by_phrasing: dict[str, dict] = {}  # synthetic QA: exact match per question template
    try:
        for name, task in loaded.items():
            shots = len(next(iter(task.shots.values()), [])) if task.shots else 0
            if rank == 0:
                print(f"[eval] {name}: {len(task.examples)} examples ({task.spec.kind}), {shots}-shot "
                      f"(shots from {task.fewshot_source}), {world_size} rank(s)", flush=True)
            task_start = time.perf_counter()
            metrics, records = evaluate_task(model, tokenizer, task, eval_cfg, rank, world_size)
            results.update(metrics)
            if task.spec.kind == "qa" and (groups := exact_match_by(records, "phrasing")):
                by_phrasing[name] = groups
            tasks[name] = {"kind": task.spec.kind, "source": task.source, "num_fewshot": shots,
                           "fewshot_source": task.fewshot_source,
                           "seconds": round(time.perf_counter() - task_start, 2)}
            if eval_cfg.log_samples:
                samples[name] = records
    finally:
        model.train(was_training)
    if rank == 0:
        # The console gets the per-task table; the file also has exact match per phrasing.
        print(markdown_table(results, tasks, step), flush=True)
        table = markdown_table(results, tasks, step, by_phrasing)
        if out_dir is not None:
            payload = {"step": step, "results": results, "tasks": tasks, "world_size": world_size,
                       "seconds": round(time.perf_counter() - start, 2), "config": dataclasses.asdict(eval_cfg),
                       **({"by_phrasing": by_phrasing} if by_phrasing else {}), **(meta or {})}
            json_path = Path(out_dir) / (json_name or f"{step}.json")
            paths = write_report(json_path, payload, table, samples if eval_cfg.log_samples else None)
            detail = " (with exact match per question phrasing)" if by_phrasing else ""
            print("[eval] wrote " + ", ".join(str(p) for p in paths.values()) + detail, flush=True)
        log_wandb(results, step, eval_cfg.wandb_mode, eval_cfg.wandb_project)
    return results
