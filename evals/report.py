"""Writing results: `<step>.json`, a markdown table `<step>.md` next to it, optional samples, wandb;
reading a finished run's newest results back (`eval_metrics`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from memlm.files import atomic_write_text


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def markdown_table(results: dict[str, dict], tasks: dict[str, dict], step: int,
                   by_phrasing: dict[str, dict] | None = None) -> str:
    """One row per (task, metric); MMLU subjects in a second table; exact
    match per question phrasing (synthetic QA), best first, in a third."""
    lines = [f"Evaluation at step {step}", "", "| task | shots | n | metric | value |", "|---|---:|---:|---|---:|"]
    subjects = []
    for key, metrics in results.items():
        if "/" in key:
            subjects.append((key, metrics))
            continue
        shots = tasks.get(key, {}).get("num_fewshot", "")
        for metric, value in metrics.items():
            if metric != "n":
                lines.append(f"| {key} | {shots} | {metrics['n']} | {metric} | {_fmt(value)} |")
    if subjects:
        lines += ["", "| subject | n | acc |", "|---|---:|---:|"]
        lines += [f"| {key} | {m['n']} | {_fmt(m['acc'])} |" for key, m in subjects]
    if by_phrasing:
        lines += ["", "| task | phrasing | n | exact_match |", "|---|---|---:|---:|"]
        for task, groups in by_phrasing.items():
            ranked = sorted(groups.items(), key=lambda kv: (-kv[1]["exact_match"], kv[0]))
            lines += [f"| {task} | {g} | {m['n']} | {_fmt(m['exact_match'])} |" for g, m in ranked]
    return "\n".join(lines) + "\n"


REPORT_KEYS = ("step", "results", "tasks", "config")  # what every results JSON holds (evals/suite.py)


def report_paths(json_path: Path, samples: bool) -> dict[str, Path]:
    """The files a report writes: the JSON, the markdown table (same name, .md) and, with
    samples, `<name>_samples.jsonl`."""
    paths = {"json": json_path, "markdown": json_path.with_suffix(".md")}
    if samples:
        paths["samples"] = json_path.with_name(f"{json_path.stem}_samples.jsonl")
    return paths


def is_report(json_path: Path) -> bool:
    """Whether `json_path` is a results JSON memlm.evals wrote (so its report files may be replaced)."""
    try:
        payload = json.loads(Path(json_path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(payload, dict) and all(key in payload for key in REPORT_KEYS)


def eval_metrics(dump_dir: Path) -> dict[str, float]:
    """Scalar results of the newest `<dump_dir>/evals/*.json` (highest step), flattened: `{"task/metric": value}`
    (what a sweep's summary and the ablation report read of a finished run)."""
    newest, step = None, -1
    for path in sorted((dump_dir / "evals").glob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(payload, dict) and isinstance(payload.get("step", 0), int) and payload.get("step", 0) >= step:
            newest, step = payload, payload.get("step", 0)
    flat: dict[str, float] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix] = value

    walk("", (newest or {}).get("results", {}))
    return flat


def write_report(json_path: Path, payload: dict, table: str, samples: dict[str, list[dict]] | None) -> dict[str, Path]:
    """Write the JSON, the markdown table (same name, .md) and, if given, the
    samples (`<name>_samples.jsonl`, one record per line with its task)."""
    paths = report_paths(json_path, samples is not None)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan: an empty metric is NaN rather than a fake 0; Python's json reads it back.
    atomic_write_text(json_path, json.dumps(payload, indent=2, allow_nan=True) + "\n")
    atomic_write_text(paths["markdown"], table)
    if samples is not None:
        lines = [json.dumps({"task": task, **r}, ensure_ascii=False) for task, recs in samples.items() for r in recs]
        atomic_write_text(paths["samples"], "\n".join(lines) + "\n")
    return paths


def log_wandb(results: dict[str, dict], step: int, mode: str, project: str) -> None:
    """Into the active wandb run when there is one (the trainer's), else a new
    `eval` run in `mode` (offline needs no network)."""
    if mode == "disabled":
        return
    import wandb

    own = wandb.run is None
    run = wandb.init(project=project, mode=mode, job_type="eval") if own else wandb.run
    flat = {f"eval/{task}/{metric}": value for task, metrics in results.items() for metric, value in metrics.items()}
    run.log({**flat, "eval/step": step})
    if own:
        run.finish()
