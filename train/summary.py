"""summary.json: what a finished (or preempted) run reports.

    summary = run_summary(name=cfg.name, steps=step, tokens=tokens, metrics=last, val_loss=val_loss, evals=evals,
                          nonfinite_skipped=skipped, preempted=False, seconds=elapsed, dump_dir=dump_dir,
                          environment=run_environment())  # read at the run's start
    write_summary(dump_dir, summary, trained=bool(last))
    print(summary_line(summary))   # one readable line; the numbers are in summary.json

A requeue of a run that had already finished trains no step, so it cannot
measure a final loss or rerun the evaluations: it keeps the results the
summary.json of that same step already holds instead of overwriting them
with nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memlm.files import atomic_write_json


def run_summary(*, name: str, steps: int, tokens: int, metrics: dict, val_loss: float | None,
                evals: dict[str, Any], nonfinite_skipped: int, preempted: bool, seconds: float,
                dump_dir: Path, environment: dict[str, object]) -> dict[str, Any]:
    """The summary of a run; `metrics` are the last logged step's (its loss is the final loss).
    `environment`: the commit, torch and CPU it ran on (memlm.machine.run_environment, read when the
    run started: the checkout may move while it trains), which its record names."""
    return {"name": name, "steps": steps, "tokens": tokens, "final_loss": metrics.get("loss"),
            "val_loss": val_loss, "evals": evals, "nonfinite_skipped": nonfinite_skipped,
            "preempted": preempted, "seconds": round(seconds, 2), "dump_dir": str(dump_dir),
            "environment": environment}


def write_summary(dump_dir: Path, summary: dict[str, Any], trained: bool) -> dict[str, Any]:
    """Write summary.json atomically; returns what was written."""
    if not trained:
        summary = _with_previous_results(dump_dir, summary)
    atomic_write_json(dump_dir / "summary.json", summary, indent=2)
    return summary


def _with_previous_results(dump_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The results summary.json already holds for this same step fill the
    ones this invocation could not measure (no step, so no final loss)."""
    try:
        previous = json.loads((dump_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return summary
    if not isinstance(previous, dict) or previous.get("steps") != summary["steps"]:
        return summary
    return {**summary, **{k: previous[k] for k in ("final_loss", "val_loss", "evals")
                          if summary.get(k) in (None, {}) and k in previous}}


def summary_line(summary: dict[str, Any]) -> str:
    """The console's last word on a run: what it reached and where the full record is."""
    word = "preempted: checkpointed and stopped" if summary["preempted"] else "done"
    parts = [f"step {summary['steps']:,}", f"{summary['tokens']:,} tokens"]
    if summary.get("final_loss") is not None:
        parts.append(f"loss {summary['final_loss']:.4f}")
    if summary.get("val_loss") is not None:
        parts.append(f"val_loss {summary['val_loss']:.4f}")
    if summary.get("nonfinite_skipped"):
        parts.append(f"{summary['nonfinite_skipped']} non-finite step(s) skipped")
    parts.append(f"{summary['seconds']:.1f}s")
    return f"[train] {word}: {', '.join(parts)} -> {Path(summary['dump_dir']) / 'summary.json'}"


def recorded_summary(summary: dict[str, Any], dump_dir: Path) -> dict[str, Any]:
    """A run with nothing to train: its summary.json as it is when it is this step's, else `summary`."""
    try:
        recorded = json.loads((dump_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return summary
    return recorded if isinstance(recorded, dict) and recorded.get("steps") == summary["steps"] else summary


def settings_not_recorded(dump_dir: Path, config_yaml: str) -> str | None:
    """A run with nothing to train leaves its config.yaml as it was: the line naming this command's
    settings (`config_yaml`) that differ from it, or None."""
    from omegaconf import OmegaConf

    path = dump_dir / "config.yaml"
    if not path.is_file():
        return None

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(tree, dict) or not tree:
            return {prefix[:-1]: tree}
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    recorded = flat(OmegaConf.to_container(OmegaConf.create(path.read_text())))
    ours = flat(OmegaConf.to_container(OmegaConf.create(config_yaml)))
    differ = sorted(key for key in recorded.keys() | ours.keys() if recorded.get(key) != ours.get(key))
    if not differ:
        return None
    return (f"[train] {path} is left as it was, so this command's settings that differ from it are "
            f"not recorded: {', '.join(differ)}")
