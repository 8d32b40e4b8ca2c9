"""`python -m memlm.launch slurm`: one sbatch job running torchrun on every node.

    python -m memlm.launch slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 [--dry-run] -- model=1b name=big

The job runs a snapshot of the code taken at submission (a queued job must not
pick up later edits of the checkout) with the resolved config saved next to
it, all under `<dump_dir>/launch/`. It takes whole nodes (or the CPUs and
memory asked for), hands them to srun, meets at a rendezvous port of its own
(derived from the job id) and writes one log per rank. Preemption: Slurm
signals the batch shell (`--signal`, SIGUSR1 by default, `--signal-seconds`
before the time limit), the shell forwards it to the ranks through srun and
torchrun, the ranks checkpoint and exit (memlm.train.preemption), and the
shell requeues the job, whose next attempt runs with resume=auto. A SIGTERM
(Slurm ending the job) is forwarded the same way, without a requeue of its own.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memlm.errors import ConfigError
from memlm.launch.validate import LaunchError, check_positive, compose_for_launch, has_key
from memlm.train.preemption import PREEMPTION_SIGNALS

# Not part of the code: environments, outputs, caches and VCS data (.gitignore's list).
SNAPSHOT_EXCLUDE = (".venv", "runs", "data_cache", "__pycache__", ".git", "build", "dist", "*.egg-info",
                    ".pytest_cache", ".ruff_cache", "outputs", "multirun", "wandb")
# Slurm --time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$")
_HYDRA_SAFE = re.compile(r"^[A-Za-z0-9_./+:-]+$")
_MEM = re.compile(r"^\d+[KMGT]?$")  # sbatch --mem: a size in MB, or with a K/M/G/T suffix
# The signals the batch script traps and forwards (USR1, TERM): those the trainer stops on.
SIGNALS = tuple(s.name.removeprefix("SIG") for s in PREEMPTION_SIGNALS)
# --port 0: each job's rendezvous port is PORT_BASE + job id % PORT_SPAN (below Linux's ephemeral
# ports, 32768+), so two jobs sharing a node do not meet at one port.
PORT_BASE, PORT_SPAN = 20000, 10000


@dataclass
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: int = 8
    partition: str = ""
    time: str = ""
    account: str = ""
    qos: str = ""
    # CPUs of each node's one task (its torchrun agent and all its ranks); 0 -> the whole node (--exclusive).
    cpus_per_task: int = 0
    mem: str = "0"  # memory per node (sbatch --mem); 0 -> all of the node's memory
    port: int = 0  # c10d rendezvous port on the first node; 0 -> derived from the job id
    max_restarts: int = 0  # torchrun elastic restarts inside one job
    signal: str = SIGNALS[0]  # the signal Slurm sends before the time limit (USR1): checkpoint, then requeue
    signal_seconds: int = 120  # how long before the time limit
    sbatch_args: list[str] = field(default_factory=list)  # extra `#SBATCH` options, e.g. --constraint=h100
    python: str = sys.executable  # the interpreter on the nodes (same path on a shared filesystem)


@dataclass
class SlurmJob:
    """Everything one submission writes: where, and the script text."""

    dump_dir: Path
    launch_dir: Path
    code_dir: Path  # holds memlm/ (put on PYTHONPATH)
    script: str
    config_yaml: str


def check_options(opts: SlurmOptions) -> None:
    check_positive("--nodes", opts.nodes)
    check_positive("--gpus-per-node", opts.gpus_per_node)
    if opts.cpus_per_task < 0:
        raise LaunchError(f"--cpus-per-task {opts.cpus_per_task}: must be >= 0 (0 = every CPU of the node)")
    if not _MEM.match(opts.mem):
        raise LaunchError(f"--mem {opts.mem!r}: a size per node as sbatch takes it, e.g. 500G or 64000 (MB); "
                          "0 = all of the node's memory")
    if not 0 <= opts.port <= 65535:
        raise LaunchError(f"--port {opts.port}: must be a TCP port in 1..65535 (0 = derived from the job id)")
    if opts.signal not in SIGNALS:
        raise LaunchError(f"--signal {opts.signal!r}: one of {', '.join(SIGNALS)} (the ranks checkpoint on either)")
    if opts.max_restarts < 0:
        raise LaunchError(f"--max-restarts {opts.max_restarts}: must be an integer >= 0")
    if opts.signal_seconds < 30:
        raise LaunchError(f"--signal-seconds {opts.signal_seconds}: must be >= 30 (time to write a checkpoint)")
    if opts.time and not _TIME.match(opts.time):
        raise LaunchError(f"--time {opts.time!r}: use a Slurm time: MINUTES, HH:MM:SS, D-HH or D-HH:MM:SS")
    for arg in opts.sbatch_args:
        if not arg.startswith("--") or "\n" in arg:
            raise LaunchError(f"--sbatch-arg {arg!r}: must be one long sbatch option, e.g. --constraint=h100")


def hydra_value(text: str) -> str:
    """`text` as a Hydra override value (quoted when it has characters Hydra parses)."""
    if _HYDRA_SAFE.match(text):
        return text
    if "'" in text:
        raise LaunchError(f"path {text!r}: contains a single quote, which cannot be passed as a Hydra value")
    return f"'{text}'"


def attempt_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """The resume overrides of the first attempt and of requeued attempts.

    First: resume=auto (a fresh dump_dir starts at step 0, or from init_from
    when given; an existing one continues; torchrun restarts inside the job
    continue too), unless the user chose resume. Requeued: always the newest
    checkpoint of this run, so init_from is cleared.
    """
    first = [] if has_key(overrides, "resume") else ["resume=auto"]
    return first, ["resume=auto", "init_from="]


def prepare_job(overrides: Sequence[str], opts: SlurmOptions, code_dir: Path | None = None) -> SlurmJob:
    """Validate everything and render the script; writes nothing."""
    from memlm.config.run import to_yaml

    check_options(opts)
    world = opts.nodes * opts.gpus_per_node
    desc = f"--nodes {opts.nodes} x --gpus-per-node {opts.gpus_per_node}"
    cfg = compose_for_launch(overrides, world, desc)
    dump_dir = Path(cfg.dump_dir).absolute()
    # The absolute dump_dir replaces any given one (Hydra's last value would win anyway).
    job_overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "dump_dir"]
    job_overrides.append(f"dump_dir={hydra_value(str(dump_dir))}")
    first, requeued = attempt_overrides(job_overrides)
    # The requeued attempt's command must compose too (checked now, not at 3 a.m.).
    compose_for_launch([*job_overrides, *requeued], world, desc)
    final_cfg = compose_for_launch([*job_overrides, *first], world, desc)
    check_checkpoint_cadence(final_cfg)
    launch_dir = dump_dir / "launch"
    code_dir = code_dir or launch_dir / "code"
    script = render_script(job_overrides, first, requeued, opts, cfg.name, launch_dir, code_dir)
    return SlurmJob(dump_dir, launch_dir, code_dir, script, to_yaml(final_cfg))


def check_checkpoint_cadence(cfg) -> None:
    """A requeued attempt resumes from the newest checkpoint: refuse a job whose
    run writes none before its end (checkpoint.every=0), warn when the first
    periodic one would come only at the end."""
    from memlm.config.run import CheckpointConfig

    every, steps = cfg.checkpoint.every, cfg.steps
    if every == 0:
        raise ConfigError("checkpoint.every", every,
                          "a number of steps >= 1 in a Slurm job: a requeued attempt (time limit, node failure, "
                          "preemption) resumes from the newest checkpoint, and with 0 it would start again from "
                          f"step 0; leave the default ({CheckpointConfig().every}) or set one")
    if every >= steps:
        print(f"[launch] WARNING: checkpoint.every={every} >= steps={steps}: no checkpoint before the run's end, "
              "so a requeued attempt after a node failure or a preemption starts again from step 0",
              file=sys.stderr, flush=True)


def _q(items: Sequence[str]) -> str:
    """Shell words; Hydra-quoted values ('a=1,b') go in double quotes, which
    keep them readable and are safe when nothing in them expands."""
    def one(item: str) -> str:
        if "'" in item and not any(c in item for c in '$`"\\!'):
            return f'"{item}"'
        return shlex.quote(item)

    return " ".join(one(i) for i in items)


def render_script(overrides: Sequence[str], first: Sequence[str], requeued: Sequence[str], opts: SlurmOptions,
                  job_name: str, launch_dir: Path, code_dir: Path) -> str:
    sbatch = [f"--job-name={job_name}", f"--nodes={opts.nodes}", "--ntasks-per-node=1",
              f"--gpus-per-node={opts.gpus_per_node}",
              f"--cpus-per-task={opts.cpus_per_task}" if opts.cpus_per_task else "--exclusive", f"--mem={opts.mem}"]
    for flag, value in (("partition", opts.partition), ("time", opts.time), ("account", opts.account),
                        ("qos", opts.qos)):
        if value:
            sbatch.append(f"--{flag}={value}")
    sbatch += [f"--output={launch_dir}/slurm-%j.out", "--open-mode=append", f"--chdir={Path.cwd()}"]
    sbatch_lines = "\n".join(f"#SBATCH {shlex.quote(s)}" for s in [*sbatch, *opts.sbatch_args])
    restarts = f"  --max-restarts {opts.max_restarts} \\\n" if opts.max_restarts else ""
    # Elastic restarts need a rendezvous store the ranks do not share (pytorch/pytorch#135712).
    unshared = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" if opts.max_restarts else ""
    port = str(opts.port) if opts.port else f"$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"
    cpus = str(opts.cpus_per_task) if opts.cpus_per_task else "$SLURM_CPUS_ON_NODE"
    cpus_note = "--cpus-per-task" if opts.cpus_per_task else "every CPU of the node: an --exclusive job"
    sig = opts.signal
    requeue_if = f'[ "$STOP_SIGNAL" = {sig} ]'
    if sig == "TERM":  # scancel sends SIGTERM too: requeue only a job Slurm still counts as running
        requeue_if += ' && scontrol show job "$SLURM_JOB_ID" | grep -q "JobState=RUNNING"'
    return f"""#!/bin/bash
# memlm training job, written by `python -m memlm.launch slurm` on {time.strftime('%Y-%m-%d %H:%M:%S')}.
# Submit it again as is with: sbatch {launch_dir}/job.sbatch
{sbatch_lines}
# SIG{sig} goes to this batch shell (B:) {opts.signal_seconds} s before the time limit: the trap
# below forwards it to the ranks (they checkpoint and exit) and requeues the job.
# --requeue also lets Slurm requeue it after a node failure or a requeueing preemption.
#SBATCH --signal=B:{sig}@{opts.signal_seconds}
#SBATCH --requeue

set -uo pipefail

# Run the code snapshot taken at submission, not the live checkout.
export PYTHONPATH={shlex.quote(str(code_dir))}${{PYTHONPATH:+:$PYTHONPATH}}
export PYTHONUNBUFFERED=1  # each rank's lines reach its log as they are printed
# torchrun forwards SIGUSR1 and SIGTERM to its ranks and gives them this long to checkpoint.
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCHELASTIC_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={opts.signal_seconds - 20}
{unshared}
RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
RDZV_PORT={port}
# The CPUs of each node's one task ({cpus_note}), shared by its torchrun agent and all of
# its ranks. srun does not inherit sbatch's --cpus-per-task (Slurm 22.05 and later): it gets them below.
CPUS_PER_TASK={cpus}
ATTEMPT=$((${{SLURM_RESTART_COUNT:-0}} + 1))
# One log per rank: each node's torchrun writes its ranks' output to
# $RANK_LOGS/node<N>/<job id>_*/attempt_<restart>/<local rank>/stdout.log and stderr.log.
export RANK_LOGS={shlex.quote(str(launch_dir / "logs"))}/job$SLURM_JOB_ID-attempt$ATTEMPT

# A requeued attempt (SLURM_RESTART_COUNT > 0) continues from the newest checkpoint.
RESUME=({_q(first)})
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then
  RESUME=({_q(requeued)})
fi
echo "[launch] job $SLURM_JOB_ID attempt $ATTEMPT on $SLURM_NNODES node(s), $CPUS_PER_TASK CPU(s) per node, \\
rendezvous $RDZV_HOST:$RDZV_PORT, rank logs $RANK_LOGS, extra overrides: ${{RESUME[*]:-none}}"

STOP_SIGNAL=""  # the first signal that came: USR1 (time limit near) or TERM (Slurm ends the job)
SRUN_PID=""
forward_signal() {{
  [ -n "$STOP_SIGNAL" ] || STOP_SIGNAL=$1
  echo "[launch] $(date '+%F %T') SIG$1: asking the ranks to checkpoint and stop"
  [ -n "$SRUN_PID" ] && kill -"$1" "$SRUN_PID" 2>/dev/null
}}
trap 'forward_signal USR1' USR1
trap 'forward_signal TERM' TERM

# One task per node, each a torchrun agent with the node's CPUs and all the job's memory there;
# c10d rendezvous on the first node. bash -c names the node's log folder (SLURM_NODEID is per task).
srun --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" --mem=0 --kill-on-bad-exit=1 \\
  bash -c 'PET_LOG_DIR="$RANK_LOGS/node$SLURM_NODEID" exec "$@"' memlm-node \\
  {shlex.quote(opts.python)} -m torch.distributed.run \\
  --nnodes "$SLURM_NNODES" --nproc_per_node {opts.gpus_per_node} \\
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \\
  --redirects 3 --tee 3 \\
{restarts}  -m memlm.train \\
  {_q(overrides)} ${{RESUME[@]+"${{RESUME[@]}}"}} &
SRUN_PID=$!
# `wait` returns early when a trapped signal arrives: wait until srun has exited.
while true; do
  wait "$SRUN_PID"
  RC=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break
done
if {requeue_if}; then
  echo "[launch] requeueing job $SLURM_JOB_ID; the next attempt resumes from the newest checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
if [ -n "$STOP_SIGNAL" ]; then
  echo "[launch] stopped by SIG$STOP_SIGNAL, not requeued by this script (a preempted job is requeued by Slurm \\
when the cluster's PreemptMode says so; sbatch this script again to resume)"
fi
echo "[launch] training exited with code $RC"
exit "$RC"
"""


def package_dir() -> Path:
    import memlm

    return Path(memlm.__file__).resolve().parent


def snapshot_code(code_dir: Path, src: Path | None = None) -> tuple[int, int]:
    """Copy the memlm package to `code_dir/memlm`; returns (files, bytes)."""
    src = (src or package_dir()).resolve()
    dst = code_dir / "memlm"
    stop_at = code_dir.resolve()
    by_pattern = shutil.ignore_patterns(*SNAPSHOT_EXCLUDE)

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = set(by_pattern(folder, names))
        # A run directory inside the checkout would otherwise be copied into itself.
        for name in names:
            path = (Path(folder) / name).resolve()
            if path == stop_at or path in stop_at.parents:
                skip.add(name)
        return skip

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=ignore, symlinks=True)
    files = [p for p in dst.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def write_job(job: SlurmJob, snapshot: bool = True) -> Path:
    job.launch_dir.mkdir(parents=True, exist_ok=True)
    if snapshot:
        files, size = snapshot_code(job.code_dir)
        print(f"[launch] code snapshot: {files} files, {size / 2**20:.1f} MiB -> {job.code_dir / 'memlm'}",
              file=sys.stderr, flush=True)
    (job.launch_dir / "config.yaml").write_text(job.config_yaml)
    path = job.launch_dir / "job.sbatch"
    path.write_text(job.script)
    return path


def sbatch_path() -> str:
    found = shutil.which("sbatch")
    if found is None:
        raise LaunchError("sbatch not found on PATH: submit from a Slurm login node, or print the script "
                          "with --dry-run (and run `sbatch` on it yourself)")
    return found


def submit(overrides: Sequence[str], opts: SlurmOptions, dry_run: bool = False) -> int:
    """Validate, then print the script (dry run) or write the run directory and sbatch it."""
    return submit_job(prepare_job(overrides, opts), opts, dry_run)


def submit_job(job: SlurmJob, opts: SlurmOptions, dry_run: bool = False, snapshot: bool = True) -> int:
    """Submit a prepared job; `snapshot=False` when its code_dir is already filled (sweeps share one)."""
    if dry_run:
        print(job.script, end="")
        print(f"[launch] dry run: nothing written; a submission writes {job.launch_dir}/"
              "{job.sbatch,config.yaml" + (",code/memlm" if snapshot else "") + "} and runs sbatch",
              file=sys.stderr, flush=True)
        return 0
    sbatch = sbatch_path()  # before anything is written
    path = write_job(job, snapshot)
    out = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"[launch] sbatch failed (exit code {out.returncode}): {out.stderr.strip() or out.stdout.strip()}",
              file=sys.stderr, flush=True)
        return out.returncode
    found = re.search(r"(\d+)\s*$", out.stdout.strip())
    job_id = found.group(1) if found else "?"
    print(f"[launch] submitted job {job_id}: {opts.nodes} node(s) x {opts.gpus_per_node} GPU(s), "
          f"log {job.launch_dir}/slurm-{job_id}.out, one log per rank under "
          f"{job.launch_dir}/logs/job{job_id}-attempt*/, run dir {job.dump_dir}", flush=True)
    return 0
