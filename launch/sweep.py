"""`python -m memlm.launch sweep`: the Cartesian product of Hydra sweep
overrides, one run per point, run locally (one after another, or `--jobs N` at a time)
or submitted to Slurm.

    python -m memlm.launch sweep 'memory.n_keys=128,256' 'memory.knn=16,32' -- memory=memplus memory.layers=[1]

Sweep syntax is Hydra's own (parsed by its OverridesParser): `a,b,c`,
`choice(a,b)`, `range(start,stop[,step])`, `glob(pattern)` for config groups
(`model=glob(1*)`), with `shuffle()`/`sort()`. Each point gets
`dump_dir=<base dump_dir>/<its overrides>` and `name=<base name>/<its overrides>`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memlm.errors import ConfigError
from memlm.evals.report import eval_metrics
from memlm.launch.local import read_summary, run_streaming, torchrun_command, torchrun_env
from memlm.launch.validate import LaunchError, check_positive, compose_for_launch

_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
RESERVED = ("dump_dir", "name")  # set per point by the sweep


@dataclass
class SweepPoint:
    label: str  # the swept overrides of this point, e.g. "memory.n_keys=128,memory.knn=16"
    items: list[str]  # this point's key=value for every argument before `--` (swept or not)
    overrides: list[str]  # everything passed to the trainer, in order
    dump_dir: Path
    result: dict = field(default_factory=dict)


class _GroupOptions:
    """What Hydra's glob() asks a config loader for: the presets of a config group."""

    def get_group_options(self, group: str, results_filter=None, config_name=None, overrides=None) -> list[str]:
        from memlm.config.run import GROUPS, group_options

        if group not in GROUPS:
            raise ConfigError(group, "glob(...)", f"glob() only expands config groups: {', '.join(GROUPS)}")
        return group_options(group)


def expand(sweep_args: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Parse `sweep_args` with Hydra's grammar; return (swept keys, points).
    Each point is one `key=value` per argument; non-sweep arguments appear in every point."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create(config_loader=_GroupOptions())
    try:
        parsed = parser.parse_overrides(list(sweep_args))
    except HydraException as err:
        raise ConfigError("sweep", list(sweep_args), f"Hydra sweep syntax (a,b / range() / glob()); "
                                                     f"Hydra said: {err}") from None
    axes: dict[str, list[str]] = {}
    swept: list[str] = []
    for o in parsed:
        key = o.get_key_element()
        if key in axes:
            raise ConfigError("sweep", o.input_line, f"one argument per key; {key} appears twice")
        if not o.is_sweep_override():
            axes[key] = [f"{key}={o.get_value_element_as_str()}"]
            continue
        if not o.is_discrete_sweep():
            raise ConfigError(key, o.get_value_string(), "a list a,b / choice() / range() / glob(); interval() "
                                                         "needs an optimizing sweeper, which memlm does not run")
        values = list(o.sweep_string_iterator())
        if not values:
            raise ConfigError(key, o.get_value_string(), "a sweep with at least one value (it matched nothing)")
        axes[key] = [f"{key}={v}" for v in values]
        swept.append(key)
    return swept, [list(p) for p in itertools.product(*axes.values())]


def point_label(items: Sequence[str], swept: Sequence[str]) -> str:
    """The swept `key=value`s of a point; for a one-point sweep (no argument
    with several values) its arguments themselves, so a run of
    `sweep memory.n_keys=32` is labelled (and its folder named) after them."""
    keys = set(swept)
    return ",".join(i for i in items if i.split("=", 1)[0] in keys) or ",".join(items) or "default"


def safe_dirname(label: str) -> str:
    """A directory name for a point label: unsafe characters -> '_', long ones shortened with a hash."""
    name = _UNSAFE.sub("_", label).lstrip(".-") or "point"
    if len(name) > 150:
        name = f"{name[:140]}-{hashlib.sha1(label.encode()).hexdigest()[:8]}"
    return name


def sweep_root(fixed: Sequence[str]) -> tuple[str, Path]:
    """(name, dump_dir) of the fixed overrides: the points' names and folders go under them.

    Composed, not validated: the fixed overrides alone need not be a valid run
    (the base preset's memory.knn=32 above a memory.n_keys=16 that every point's
    swept memory.knn fits); each point is validated as composed (plan)."""
    from memlm.config.run import compose_dict

    cfg = compose_dict(list(fixed))  # unknown keys and malformed overrides still fail here
    return str(cfg.name), Path(str(cfg.dump_dir))


def plan(sweep_args: Sequence[str], base: Sequence[str], world_size: int, world_desc: str) -> list[SweepPoint]:
    """Expand and validate every point before anything runs."""
    from memlm.launch.slurm import hydra_value
    from memlm.launch.validate import split_sweeps

    base_sweeps = split_sweeps(base)
    if base_sweeps:
        raise ConfigError("overrides", base_sweeps,
                          "single values after `--`; put sweeps before `--` (sweep 'a=1,2' -- b=3)")
    swept, points = expand(sweep_args)
    base_keys = {b.lstrip("+~").split("=", 1)[0] for b in base}
    for key in swept:
        if key.lstrip("+~") in RESERVED:
            raise ConfigError(key, "(swept)", f"not swept: the sweep sets {key} for every point")
    both = sorted(base_keys & {k.lstrip("+~") for k in swept})
    if both:
        raise ConfigError(both[0], "(swept and fixed)", "either swept (before `--`) or fixed (after `--`), not both")
    # Non-swept arguments before `--` (e.g. name=x under `-m`) count as fixed for the root too.
    fixed = [i for i in points[0] if i.split("=", 1)[0] not in set(swept)]
    base_name, root = sweep_root([*base, *fixed])
    out, seen = [], set()
    for items in points:
        label = point_label(items, swept)
        dirname = safe_dirname(label)
        if dirname in seen:  # two labels that differ only in unsafe characters
            dirname = f"{dirname}-{len(seen)}"
        seen.add(dirname)
        dump_dir = root / dirname
        overrides = [*base, *items, f"dump_dir={hydra_value(str(dump_dir))}",
                     f"name={hydra_value(f'{base_name}/{dirname}')}"]
        out.append(SweepPoint(label, items, overrides, dump_dir))
    for i, point in enumerate(out, 1):
        try:
            compose_for_launch(point.overrides, world_size, world_desc)
        except ConfigError as err:
            raise ConfigError(err.key, err.value, f"{err.valid} (sweep point {i}/{len(out)}: {point.label})") from None
    return out


def describe(point: SweepPoint) -> dict:
    """Parameter counts and forward FLOPs/token of a point (no model is allocated)."""
    from memlm.plan.describe import describe_row

    row = describe_row(point.overrides, None)
    return {"total": row["total"], "active": row["active"], "flops_per_token": row["flops_per_token"]}


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def summary_table(points: Sequence[SweepPoint]) -> str:
    metric_keys = sorted({k for p in points for k in p.result.get("evals", {})})
    cols = ["point", "status", "params", "active", "fwd_flops/token", "final_loss", "val_loss", *metric_keys]
    rows = []
    for p in points:
        r = p.result
        rows.append([p.label, r.get("status", "-"), r.get("total"), r.get("active"), r.get("flops_per_token"),
                     r.get("final_loss"), r.get("val_loss"), *(r.get("evals", {}).get(k) for k in metric_keys)])
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    for row in cells:
        lines.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def _command(point: SweepPoint, nproc: int, max_restarts: int) -> list[str]:
    if nproc == 1 and not max_restarts:
        return [sys.executable, "-m", "memlm.train", *point.overrides]
    return torchrun_command(point.overrides, nproc, max_restarts)


def _record(point: SweepPoint, rc: int, started: float) -> None:
    summary = read_summary(point.dump_dir, started) or {}
    point.result.update(status="ok" if rc == 0 else f"failed ({rc})", final_loss=summary.get("final_loss"),
                        val_loss=summary.get("val_loss"), evals=eval_metrics(point.dump_dir))


def _run_concurrently(points: Sequence[SweepPoint], jobs: int, nproc: int, max_restarts: int) -> int:
    """Up to `jobs` points at once (e.g. one per CPU core); each one's output goes
    to <dump_dir>/sweep.log, the console gets a line when a point starts and ends."""
    failed, queue, running = 0, list(enumerate(points, 1)), []
    while queue or running:
        while queue and len(running) < jobs:
            i, point = queue.pop(0)
            point.dump_dir.mkdir(parents=True, exist_ok=True)
            log = open(point.dump_dir / "sweep.log", "w")
            print(f"[sweep] point {i}/{len(points)} started: {point.label} (log: {log.name})", flush=True)
            proc = subprocess.Popen(_command(point, nproc, max_restarts), stdout=log, stderr=subprocess.STDOUT,
                                    env=torchrun_env(max_restarts))
            running.append((i, point, proc, log, time.time()))
        time.sleep(0.5)
        for entry in [e for e in running if e[2].poll() is not None]:
            i, point, proc, log, started = entry
            running.remove(entry)
            log.close()
            _record(point, proc.returncode, started)
            failed += proc.returncode != 0
            print(f"[sweep] point {i}/{len(points)} {point.result['status']} after {time.time() - started:.0f}s: "
                  f"{point.label}" + ("" if proc.returncode == 0 else f" (see {log.name})"), flush=True)
    return failed


def run_local(points: Sequence[SweepPoint], nproc: int = 1, max_restarts: int = 0, jobs: int = 1) -> int:
    """Run the points (one after another, or `jobs` at a time); a failed point is
    reported and the sweep goes on."""
    if jobs > 1:
        failed = _run_concurrently(points, jobs, nproc, max_restarts)
    else:
        failed = 0
        for i, point in enumerate(points, 1):
            print(f"[sweep] point {i}/{len(points)}: {point.label} -> {point.dump_dir}", flush=True)
            started = time.time()
            rc = run_streaming(_command(point, nproc, max_restarts), point.dump_dir, torchrun_env(max_restarts))
            _record(point, rc, started)
            failed += rc != 0
    for point in points:
        point.result.update(describe(point))
    print(f"\n[sweep] {len(points) - failed}/{len(points)} point(s) finished"
          + (f", {failed} failed" if failed else "") + "\n" + summary_table(points), flush=True)
    print("\nfwd_flops/token: forward FLOPs per token (a training step is ~3x); final_loss: last training step; "
          "eval columns: the newest <dump_dir>/evals/*.json", flush=True)
    write_record(points)
    return 1 if failed else 0


def write_record(points: Sequence[SweepPoint]) -> None:
    root = points[0].dump_dir.parent
    record = [{"point": p.label, "dump_dir": str(p.dump_dir), "overrides": p.overrides, **p.result} for p in points]
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[sweep] wrote {root / 'sweep.json'}", flush=True)


def run_slurm(points: Sequence[SweepPoint], opts, dry_run: bool = False) -> int:
    """One sbatch job per point, all sharing one code snapshot under the sweep's root."""
    from memlm.launch import slurm

    out = sys.stderr if dry_run else sys.stdout
    code_dir = points[0].dump_dir.parent.absolute() / "launch" / "code"
    # Every script is rendered (and so checked) before the first submission.
    jobs = [slurm.prepare_job(point.overrides, opts, code_dir) for point in points]
    if not dry_run:
        slurm.sbatch_path()
        files, size = slurm.snapshot_code(code_dir)
        print(f"[sweep] code snapshot: {files} files, {size / 2**20:.1f} MiB -> {code_dir / 'memlm'}", flush=True)
    failed = 0
    for i, (point, job) in enumerate(zip(points, jobs), 1):
        print(f"[sweep] point {i}/{len(points)}: {point.label}", file=out, flush=True)
        failed += slurm.submit_job(job, opts, dry_run, snapshot=False) != 0
    print(f"[sweep] {len(points) - failed}/{len(points)} point(s) " + ("printed (dry run)" if dry_run else "submitted")
          + (f", {failed} failed" if failed else ""), file=out, flush=True)
    return 1 if failed else 0


def sweep(sweep_args: Sequence[str], base: Sequence[str], nproc: int = 1, max_restarts: int = 0,
          slurm_opts=None, dry_run: bool = False, jobs: int = 1) -> int:
    if not sweep_args:
        raise LaunchError("sweep needs at least one override before `--`, e.g. 'memory.n_keys=128,256'")
    check_positive("--jobs", jobs)
    if slurm_opts is not None and jobs != 1:
        raise LaunchError(f"--jobs {jobs} runs local points side by side; with --slurm every point is its own job")
    if slurm_opts is None:
        check_positive("--nproc", nproc)
        world, desc = nproc, f"--nproc {nproc}"
    else:
        world = slurm_opts.nodes * slurm_opts.gpus_per_node
        desc = f"--nodes {slurm_opts.nodes} x --gpus-per-node {slurm_opts.gpus_per_node}"
    points = plan(sweep_args, base, world, desc)
    out = sys.stderr if dry_run else sys.stdout
    print(f"[sweep] {len(points)} point(s) under {points[0].dump_dir.parent}:", file=out, flush=True)
    for point in points:
        print(f"  {point.label}", file=out, flush=True)
    if slurm_opts is not None:
        return run_slurm(points, slurm_opts, dry_run)
    if dry_run:
        for point in points:
            print(shlex.join([sys.executable, "-m", "memlm.train", *point.overrides]))
        return 0
    return run_local(points, nproc, max_restarts, jobs)
