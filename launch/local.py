"""`python -m memlm.launch local`: torchrun on this machine (or one node of a
multi-node torchrun job), validated before any process starts: the config,
and the data, tokenizer and eval files it names (memlm.train.preflight)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from memlm.launch.validate import LaunchError, check_positive, compose_for_launch
from memlm.train.preflight import check_run_inputs

TRAIN_MODULE = "memlm.train"


def torchrun_command(overrides: Sequence[str], nproc: int, max_restarts: int = 0, nnodes: int = 1,
                     rdzv_endpoint: str = "", rdzv_id: str = "memlm", python: str = sys.executable) -> list[str]:
    """The torchrun command line. One node: `--standalone` (torchrun picks a
    free local rendezvous port). Several nodes: c10d rendezvous at
    `rdzv_endpoint`, so no node needs to know its rank in advance."""
    cmd = [python, "-m", "torch.distributed.run"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    cmd += ["--nproc_per_node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return [*cmd, "-m", TRAIN_MODULE, *overrides]


def torchrun_env(max_restarts: int, base: dict | None = None) -> dict[str, str]:
    """The environment for torchrun. With elastic restarts the rendezvous TCP
    store must not be shared with the ranks: a restarted group can read the
    previous attempt's peer addresses from it and fail to connect
    (pytorch/pytorch#135712; seen here with gloo on torch 2.13)."""
    env = dict(os.environ if base is None else base)
    if max_restarts:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def check_local(overrides: Sequence[str], nproc: int, max_restarts: int = 0, nnodes: int = 1,
                rdzv_endpoint: str = ""):
    """Every check of a local launch; returns the composed Config."""
    check_positive("--nproc", nproc)
    check_positive("--nnodes", nnodes)
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts {max_restarts}: must be an integer >= 0")
    if nnodes > 1 and not rdzv_endpoint:
        raise LaunchError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (a host every node can reach)")
    if rdzv_endpoint and ":" not in rdzv_endpoint:
        raise LaunchError(f"--rdzv-endpoint {rdzv_endpoint!r}: must be HOST:PORT, e.g. node0:29500")
    world_desc = f"--nproc {nproc}" if nnodes == 1 else f"--nnodes {nnodes} x --nproc {nproc}"
    cfg = compose_for_launch(overrides, nproc * nnodes, world_desc)
    check_run_inputs(cfg)  # data, tokenizer and eval files: one line here, not one per rank under torchrun
    return cfg


def run_local(overrides: Sequence[str], nproc: int, max_restarts: int = 0, nnodes: int = 1,
              rdzv_endpoint: str = "", rdzv_id: str = "memlm", env: dict | None = None) -> int:
    """Validate, run torchrun with its output streamed to this terminal, and
    print a summary. Returns torchrun's exit code."""
    cfg = check_local(overrides, nproc, max_restarts, nnodes, rdzv_endpoint)
    if max_restarts and cfg.resume == "none":
        # With resume=none a restarted group would start again from step 0.
        print(f"[launch] note: --max-restarts {max_restarts} with resume=none: restarted ranks begin at "
              "step 0; leave resume at its default (auto, with checkpoint.every=N) to continue from the "
              "newest checkpoint", flush=True)
    cmd = torchrun_command(overrides, nproc, max_restarts, nnodes, rdzv_endpoint, rdzv_id)
    print(f"[launch] {nproc * nnodes} rank(s) ({nnodes} node(s) x {nproc}), dump_dir {cfg.dump_dir}", flush=True)
    print(f"[launch] {shlex.join(cmd)}", flush=True)
    return run_streaming(cmd, Path(cfg.dump_dir), torchrun_env(max_restarts, env))


def run_streaming(cmd: list[str], dump_dir: Path, env: dict | None = None) -> int:
    """Run `cmd` with inherited stdout/stderr (live output), then summarize the run."""
    start = time.time()
    proc = subprocess.Popen(cmd, env=env)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached torchrun too (same process group); let it stop its ranks.
        print("[launch] interrupted; waiting for torchrun to stop its ranks", file=sys.stderr, flush=True)
        rc = proc.wait()
    print(summary_line(rc, time.time() - start, dump_dir, start), flush=True)
    return rc


def read_summary(dump_dir: Path, newer_than: float = 0.0) -> dict | None:
    """The run's summary.json, if the trainer wrote one after `newer_than` (a time.time())."""
    path = dump_dir / "summary.json"
    try:
        if path.stat().st_mtime < newer_than:
            return None  # left over from an earlier run in the same dump_dir
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary_line(rc: int, seconds: float, dump_dir: Path, started: float) -> str:
    summary = read_summary(dump_dir, started)
    if rc == 0 and summary:
        loss = summary.get("final_loss")
        loss_text = f"{loss:.4f}" if isinstance(loss, float) else str(loss)
        return (f"[launch] done in {seconds:.1f}s: {summary.get('steps')} steps, final loss {loss_text} "
                f"-> {dump_dir / 'summary.json'}")
    if rc == 0:
        return f"[launch] exited 0 after {seconds:.1f}s (no new {dump_dir / 'summary.json'})"
    return f"[launch] FAILED with exit code {rc} after {seconds:.1f}s; the rank errors are printed above"
