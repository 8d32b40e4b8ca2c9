"""Command line of `python -m memlm.launch` (local | slurm | sweep).

Launcher options come first, Hydra overrides of the run after `--`. Every
command composes and validates the config before any process starts or any
file is written.
"""

from __future__ import annotations

import argparse
import sys

from memlm.errors import entry_point

DESCRIPTION = """Turn a memlm config (or a sweep of configs) into training processes.

  python -m memlm.launch local --nproc 2 -- model=tiny data=synthetic steps=200
  python -m memlm.launch local --nproc 8 --nnodes 2 --rdzv-endpoint node0:29500 -- ...   (run on each node)
  python -m memlm.launch slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 [--dry-run] -- model=1b memory=memplus
  python -m memlm.launch sweep 'memory.n_keys=128,256' 'memory.knn=16,32' -- memory=memplus memory.layers=[1]
  python -m memlm.launch sweep 'optim.lr=range(1,4)' --slurm --nodes 1 --gpus-per-node 8 -- ...

Details: docs/launch.md. `<command> --help` lists each command's options.
"""


def _add_slurm_options(p: argparse.ArgumentParser) -> None:
    from memlm.launch.slurm import PORT_BASE, PORT_SPAN, SIGNALS

    g = p.add_argument_group("Slurm")
    g.add_argument("--nodes", type=int, default=1, help="nodes (one torchrun agent each; default 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node = ranks per node (default 8)")
    g.add_argument("--partition", default="", help="sbatch --partition")
    g.add_argument("--time", default="", help="sbatch --time, e.g. 24:00:00 or 2-00:00:00")
    g.add_argument("--account", default="", help="sbatch --account")
    g.add_argument("--qos", default="", help="sbatch --qos")
    g.add_argument("--cpus-per-task", type=int, default=0,
                   help="CPUs per node for its torchrun agent and all its ranks, passed to sbatch and srun "
                        "(default 0: whole nodes, sbatch --exclusive)")
    g.add_argument("--mem", default="0", help="memory per node, e.g. 500G (default 0: all of the node's memory)")
    g.add_argument("--port", type=int, default=0,
                   help=f"c10d rendezvous port on the first node (default 0: {PORT_BASE} + job id %% {PORT_SPAN})")
    g.add_argument("--signal", default=SIGNALS[0], choices=SIGNALS,
                   help=f"the signal Slurm sends before the time limit: checkpoint + requeue (default {SIGNALS[0]})")
    g.add_argument("--signal-seconds", type=int, default=120,
                   help="how many seconds before the time limit the signal comes (default 120)")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION",
                   help="extra sbatch option, repeatable, e.g. --sbatch-arg=--constraint=h100")
    g.add_argument("--python", default=sys.executable, help="python on the nodes (default: this interpreter)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m memlm.launch", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{local,slurm,sweep}")

    local = sub.add_parser("local", help="torchrun on this machine (one node of a multi-node job)",
                           description="Run torchrun here: python -m memlm.launch local --nproc N -- overrides")
    local.add_argument("--nproc", type=int, required=True, help="ranks on this machine")
    local.add_argument("--max-restarts", type=int, default=0,
                       help="torchrun elastic restarts of the whole group after a rank fails (use resume=auto)")
    local.add_argument("--nnodes", type=int, default=1, help="nodes of the job (each runs this command)")
    local.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (multi-node)")
    local.add_argument("--rdzv-id", default="memlm", help="job id shared by every node (default memlm)")
    local.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)

    slurm = sub.add_parser("slurm", help="write an sbatch script, snapshot the code, submit",
                           description="Submit a Slurm job: python -m memlm.launch slurm --nodes 4 -- overrides")
    _add_slurm_options(slurm)
    slurm.add_argument("--max-restarts", type=int, default=0, help="torchrun elastic restarts inside the job")
    slurm.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    slurm.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)

    sweep = sub.add_parser("sweep", help="one run per point of a Hydra sweep, locally or on Slurm",
                           description="python -m memlm.launch sweep 'a=1,2' 'b=range(3)' [options] -- fixed overrides")
    sweep.add_argument("sweep", nargs="+", help="Hydra sweep overrides: a,b / choice() / range() / glob()")
    sweep.add_argument("--nproc", type=int, default=1, help="ranks per point for a local sweep (default 1)")
    sweep.add_argument("--max-restarts", type=int, default=0, help="torchrun elastic restarts per point")
    sweep.add_argument("--jobs", type=int, default=1,
                       help="local points run at the same time (default 1); output then goes to <point>/sweep.log")
    sweep.add_argument("--slurm", action="store_true", help="submit one Slurm job per point")
    sweep.add_argument("--dry-run", action="store_true", help="print the commands or scripts; run nothing")
    _add_slurm_options(sweep)
    return parser


def slurm_options(args: argparse.Namespace):
    from memlm.launch.slurm import SlurmOptions

    return SlurmOptions(nodes=args.nodes, gpus_per_node=args.gpus_per_node, partition=args.partition,
                        time=args.time, account=args.account, qos=args.qos, cpus_per_task=args.cpus_per_task,
                        mem=args.mem, port=args.port, max_restarts=args.max_restarts, signal=args.signal,
                        signal_seconds=args.signal_seconds, sbatch_args=list(args.sbatch_arg), python=args.python)


@entry_point
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after the first `--` is the run's Hydra overrides, untouched by argparse.
    cut = argv.index("--") if "--" in argv else len(argv)
    own, overrides = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(own)
    if args.command is None:  # a usage mistake: the one error line, exit 2 (`--help` shows the commands)
        from memlm.launch.validate import LaunchError

        raise LaunchError("python -m memlm.launch needs a command: local, slurm or sweep (see --help)")
    # A bad value or option (exit 2), a data or eval file the run would read (train/preflight.py,
    # exit 1): a MemlmError, one line (entry_point).
    if args.command == "local":
        from memlm.launch.local import run_local

        return run_local([*args.overrides, *overrides], args.nproc, args.max_restarts, args.nnodes,
                         args.rdzv_endpoint, args.rdzv_id)
    if args.command == "slurm":
        from memlm.launch.slurm import submit

        return submit([*args.overrides, *overrides], slurm_options(args), args.dry_run)
    from memlm.launch.sweep import sweep

    opts = slurm_options(args) if args.slurm else None
    return sweep(args.sweep, overrides, args.nproc, args.max_restarts, opts, args.dry_run, args.jobs)
