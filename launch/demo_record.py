"""The README demo's figures, measured from a fresh clone: seeds x native top-k on/off.

    OMP_NUM_THREADS=1 python -m memlm.launch.demo_record [--seeds 0 1 2] [--commit HEAD] [--out docs/runs/demo]

For every seed, first with MEMLM_NATIVE_TOPK=1 (memory/fast/native_topk.py)
and then with 0 (torch.topk), one run at a time: `git clone` this
repository at the commit into a new temporary folder (committed files
only: no data cache, no runs, no build cache), then run
`python -m memlm.launch.demo seed=S` there with this interpreter (its
packages; the clone's memlm first on PYTHONPATH), OMP_NUM_THREADS=1.

Writes to --out: `runs.json` (per run: the two QA exact matches, final and
validation loss, every eval metric, seconds, the load average before it,
and the console's results table) and `README.md` (the machine, the table,
whether each seed's figures are equal with the kernel on and off, the range
over seeds, and the results tables verbatim). A run already in runs.json
for the same commit is not run again, so a stopped record resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from memlm.errors import MemlmError, entry_point
from memlm.files import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
TASKS = {"trained": "synthetic_qa_trained", "held_out": "synthetic_qa_seen"}
KERNEL_MISSING = "native top-k kernel is unavailable"


class DemoRecordError(MemlmError):
    """A demo run of the record failed, or did not run what it was meant to."""


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def cpu_name() -> str:
    """lscpu's model name, family and model, and the CPU count."""
    fields = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    return (f"{fields.get('Model name', '?')} (family {fields.get('CPU family', '?')}, "
            f"model {fields.get('Model', '?')}), {fields.get('CPU(s)', os.cpu_count())} CPUs")


def results_table(stdout: str) -> str:
    """The console's final results table: the last block between two dashed lines."""
    lines = stdout.rstrip().splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    if len(rules) < 2:
        raise DemoRecordError("the demo printed no results table")
    return "\n".join(lines[rules[-2]:rules[-1] + 1])


def run_demo(commit: str, seed: int, native: bool) -> dict:
    """One demo from a fresh clone at `commit`; its figures (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="memlm-demo-record-") as tmp:
        clone = Path(tmp) / "memlm"  # the folder is the package: its parent goes on PYTHONPATH
        git("clone", "--quiet", str(REPO), str(clone))
        git("checkout", "--quiet", commit, cwd=clone)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMLM_NATIVE_TOPK": "1" if native else "0",
               "MEMLM_CACHE_DIR": str(Path(tmp) / "cache"), "PYTHONPATH": tmp, "WANDB_SILENT": "true"}
        where = subprocess.run([sys.executable, "-c", "import memlm; print(memlm.__file__)"], cwd=clone, env=env,
                               capture_output=True, text=True, check=True).stdout.strip()
        if Path(where).parent != clone:
            raise DemoRecordError(f"the clone's memlm is not the one imported ({where}): check PYTHONPATH")
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "memlm.launch.demo", f"seed={seed}"], cwd=clone, env=env,
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise DemoRecordError(f"the demo at seed={seed} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        if native and KERNEL_MISSING in proc.stderr:
            raise DemoRecordError("MEMLM_NATIVE_TOPK=1 but the kernel did not build: the run would be torch.topk's")
        figures = run_figures(clone / "runs" / "demo")
    return {"commit": commit, "seed": seed, "native": native, **figures,
            "seconds": round(seconds, 1), "load_before": round(load, 2), "table": results_table(proc.stdout)}


def run_figures(run: Path) -> dict:
    """A finished demo run's figures, from its summary.json: the exact match of each of TASKS,
    final and validation loss, every eval metric."""
    summary = json.loads((run / "summary.json").read_text())
    evals = summary["evals"]
    return {**{name: evals[task]["exact_match"] for name, task in TASKS.items()},
            "final_loss": summary["final_loss"], "val_loss": summary.get("val_loss"), "evals": evals}


def same_figures(a: dict, b: dict) -> bool:
    """Whether two runs' figures are equal: every eval metric, final and validation loss."""
    return all(a[key] == b[key] for key in ("evals", "final_loss", "val_loss"))


def ranges(runs: list[dict]) -> dict[str, tuple[float, float]]:
    """Per figure (TASKS), the (min, max) exact match over the runs, in percent rounded as the
    console prints it (one decimal)."""
    return {name: (round(100 * min(r[name] for r in runs), 1), round(100 * max(r[name] for r in runs), 1))
            for name in TASKS}


def span_text(lo: float, hi: float, unit: str = "%") -> str:
    """A range as README.md states it: "52.9-53.8%", or "100.0%" when both ends are equal."""
    return f"{lo:.1f}{unit}" if lo == hi else f"{lo:.1f}-{hi:.1f}{unit}"


def render(runs: list[dict], commit_line: str, cpu: str) -> str:
    seeds = sorted({r["seed"] for r in runs})
    by = {(r["seed"], r["native"]): r for r in runs}
    rows = [f"| {r['seed']} | {int(r['native'])} | {100 * r['trained']:.1f}% | {100 * r['held_out']:.1f}% | "
            f"{r['final_loss']:.4f} | {r['val_loss']:.4f} | {r['seconds'] / 60:.1f} | {r['load_before']:.2f} |"
            for r in sorted(runs, key=lambda r: (r["seed"], not r["native"]))]
    equal = [f"seed {s}: {'equal' if same_figures(by[s, True], by[s, False]) else 'DIFFERENT'}"
             for s in seeds if (s, True) in by and (s, False) in by]
    span = ranges(runs)
    tables = [f"### seed {r['seed']}, MEMLM_NATIVE_TOPK={int(r['native'])}\n\n```\n{r['table']}\n```"
              for r in sorted(runs, key=lambda r: (r["seed"], not r["native"]))]
    return "\n".join([
        "# `make demo` from a fresh clone: seeds x native top-k",
        "",
        "Generated by `python -m memlm.launch.demo_record` (launch/demo_record.py) from its runs; "
        "`runs.json` holds the same runs with every eval metric.",
        "",
        f"- commit: {commit_line}",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        f"- CPU: {cpu}, shared with other jobs (the load average before each run is in the table)",
        "- each run: a fresh `git clone` at the commit, then `OMP_NUM_THREADS=1 MEMLM_NATIVE_TOPK=<1|0> "
        "python -m memlm.launch.demo seed=<S>` (`make demo ARGS=\"seed=<S>\"`)",
        "",
        "| seed | MEMLM_NATIVE_TOPK | facts, trained phrasing (exact match) | facts, held-out phrasings "
        "(exact match) | final train loss | validation loss | wall (min) | load average before |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Kernel on and off (every eval metric, final and validation loss): " + ", ".join(equal) + ".",
        "",
        f"Range over seeds {', '.join(map(str, seeds))}: facts, trained phrasing {span_text(*span['trained'])}; "
        f"facts, held-out phrasings {span_text(*span['held_out'])}.",
        "",
        "## The results tables, as printed",
        "",
        "\n\n".join(tables),
        "",
    ])


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.launch.demo_record", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--commit", default="HEAD", help="a commit of this repository (default HEAD)")
    parser.add_argument("--out", default=str(REPO / "docs" / "runs" / "demo"))
    args = parser.parse_args(argv)
    try:
        commit = git("rev-parse", "--verify", f"{args.commit}^{{commit}}")
    except subprocess.CalledProcessError:
        raise DemoRecordError(f"--commit {args.commit}: not a commit of {REPO}") from None
    out = Path(args.out)
    record = out / "runs.json"
    runs = [r for r in (json.loads(record.read_text()) if record.is_file() else []) if r["commit"] == commit]
    for native in (True, False):
        for seed in args.seeds:
            if any(r["seed"] == seed and r["native"] == native for r in runs):
                continue
            print(f"[demo_record] seed {seed}, MEMLM_NATIVE_TOPK={int(native)}, commit {commit[:10]}", flush=True)
            runs.append(run_demo(commit, seed, native))
            r = runs[-1]
            print(f"  trained {100 * r['trained']:.1f}%, held-out {100 * r['held_out']:.1f}%, "
                  f"{r['seconds'] / 60:.1f} min", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(record, json.dumps(runs, indent=1) + "\n")
    commit_line = f"{commit[:10]} ({git('log', '-1', '--format=%s', commit)[:100]})"
    atomic_write_text(out / "README.md", render(runs, commit_line, cpu_name()))
    print(f"[demo_record] wrote {out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
