"""Fault-injection harness: the real training CLI in subprocesses, faults injected from outside.

    ref = train(tmp_path / "ref")                          # the uninterrupted run
    out = train(tmp_path / "run", kill_at_step=9)          # SIGKILL of the process tree at step >= 9
    corrupt(newest_checkpoint(tmp_path / "run"), "bitflip")
    out = train(tmp_path / "run", "resume=auto")           # finishes the run
    assert_same_run(tmp_path / "ref", tmp_path / "run")    # every step's loss and the final tensors, bitwise

A run is `python -m memlm.train` (or `torchrun --nproc_per_node N -m memlm.train`
via memlm.launch.local, as the launcher runs it) on the tiny Memory+ model of
the README with smaller memory sizes, `logging.every=1` so metrics.jsonl holds
every step. Faults:

- `kill_at_step`: SIGKILL of the whole process group (torchrun and its ranks)
  once metrics.jsonl reaches the step; `kill_rank` kills one rank only (found
  by RANK in its environment), as a lost GPU or node would.
- `kill_at="point:step"`: the process SIGKILLs itself at a named point of the
  save of that step (tests/faults/fault_train.py lists the points).
- `fsize_limit`: `ulimit -f` (RLIMIT_FSIZE) in the child: a write past it fails
  with EFBIG (Python ignores SIGXFSZ), as on a full disk.
- `corrupt(path, how)`: bitflip, truncate or garbage a file.

Every run writes its output to `<dump_dir>.log<attempt>`; assertion messages
include the tail of it.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from launch_helpers import TEST_PYTHONPATH, TESTS_DIR, TINY

from memlm.launch.local import torchrun_command, torchrun_env

FAULT_TRAIN = TESTS_DIR / "faults" / "fault_train.py"
# TINY without its step count, plus a Memory+ layer (README's tiny Memory+ model, smaller memory).
MEMPLUS = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.heads=2", "memory.knn=4",
           "memory.eval_knn=4", "memory.k_dim=32"]
STEPS, EVERY = 20, 4
BASE = [*(o for o in TINY if not o.startswith("steps=")), *MEMPLUS, "optim.warmup=2", "logging.every=1",
        f"steps={STEPS}", f"checkpoint.every={EVERY}"]
TIMEOUT = 300  # a stuck run fails its test instead of hanging CI


@dataclass
class Result:
    returncode: int
    output: str
    killed: bool  # the harness sent the SIGKILL (kill_at_step)

    def tail(self, n: int = 4000) -> str:
        return self.output[-n:]


def train(dump_dir: Path, *extra: str, nproc: int = 1, max_restarts: int = 0, kill_at_step: int | None = None,
          kill_rank: int | None = None, kill_at: str | None = None, fsize_limit: int | None = None,
          env: dict | None = None) -> Result:
    """One attempt of the run in dump_dir (overrides: BASE + extra); returns when it has exited."""
    overrides = [*BASE, f"dump_dir={dump_dir}", *extra]
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TEST_PYTHONPATH, env.get("PYTHONPATH", "")) if p)
    if kill_at:
        env["MEMLM_FAULT_KILL_AT"] = kill_at
    if nproc == 1 and not max_restarts:
        entry = [str(FAULT_TRAIN)] if kill_at else ["-m", "memlm.train"]
        cmd = [sys.executable, *entry, *overrides]
    else:
        assert not kill_at, "kill_at: one process only"
        cmd = torchrun_command(overrides, nproc, max_restarts=max_restarts)
        env = torchrun_env(max_restarts, env)
    dump_dir = Path(dump_dir)
    dump_dir.parent.mkdir(parents=True, exist_ok=True)
    attempt = len(list(dump_dir.parent.glob(f"{dump_dir.name}.log*")))
    log = dump_dir.parent / f"{dump_dir.name}.log{attempt}"

    def limit_file_size():  # runs in the child before exec: `ulimit -f`
        if fsize_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=limit_file_size if fsize_limit is not None else None)
        killed = False
        deadline = time.monotonic() + TIMEOUT
        try:
            while proc.poll() is None:
                if kill_at_step is not None and not killed and last_step(dump_dir) >= kill_at_step:
                    if kill_rank is None:
                        os.killpg(proc.pid, signal.SIGKILL)  # the process tree: torchrun and every rank
                    else:
                        os.kill(rank_pid(proc.pid, kill_rank), signal.SIGKILL)
                    killed = True
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cmd} ran over {TIMEOUT}s; log: {log}")
                time.sleep(0.002)
        finally:
            if proc.poll() is None or kill_rank is not None:
                _kill_group(proc.pid)
    result = Result(proc.wait(), log.read_text(), killed)
    if kill_at_step is not None:
        assert killed, f"the run ended before reaching step {kill_at_step}: no fault injected\n{result.tail()}"
    return result


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def last_step(dump_dir: Path) -> int:
    """The highest step in metrics.jsonl so far (0 before the first); a half-written last line is ignored."""
    path = Path(dump_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            step = max(step, json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            pass
    return step


def rank_pid(root_pid: int, rank: int) -> int:
    """The pid of the descendant of root_pid whose environment says RANK=rank (a torchrun worker)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo = [root_pid]
    while todo:  # breadth first: the worker comes before any process it started (which inherits RANK)
        pid = todo.pop(0)
        for child in children.get(pid, []):
            try:
                environ = (Path("/proc") / str(child) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return child
            todo.append(child)
    raise AssertionError(f"no process with RANK={rank} under pid {root_pid}")


def losses(dump_dir: Path) -> dict[int, list[float]]:
    """Every logged loss per step, over every attempt of the run (a step trained twice logs twice)."""
    out: dict[int, list[float]] = {}
    abandoned = Path(dump_dir) / "metrics.abandoned.jsonl"  # rows of attempts the run went back from
    lines = abandoned.read_text().splitlines() if abandoned.is_file() else []
    for line in lines + (Path(dump_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "unreadable" in rec:
            continue
        if "loss" in rec:
            out.setdefault(rec["step"], []).append(rec["loss"])
    return out


def checkpoints(dump_dir: Path) -> list[Path]:
    """Complete checkpoints (meta.json present), oldest first."""
    root = Path(dump_dir) / "checkpoints"
    return sorted((p for p in root.glob("step_*") if (p / "meta.json").is_file()), key=lambda p: p.name)


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer), read with DCP's own converter, by flat name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(directory).parent.parent / f".tensors_{Path(directory).name}.pt"
    dcp_to_torch_save(str(directory), str(out))
    state = torch.load(out, weights_only=True)
    out.unlink()

    def flat(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}/")
            else:
                yield f"{prefix}{k}", v

    return dict(flat(state))


def assert_same_run(reference: Path, run: Path, steps: int = STEPS) -> None:
    """Every step's loss, in every attempt of `run`, equals the reference's; so do the final tensors. Bitwise."""
    ref, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, steps + 1)), f"steps logged: {sorted(got)}"
    for step, values in got.items():
        assert all(v == ref[step][0] for v in values), f"step {step}: losses {values} vs reference {ref[step]}"
    a, b = checkpoint_tensors(checkpoints(reference)[-1]), checkpoint_tensors(checkpoints(run)[-1])
    assert checkpoints(run)[-1].name == f"step_{steps:08d}"
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"final tensors differ from the uninterrupted run: {different[:8]}"


def corrupt(path: Path, how: str, seed: int = 0) -> None:
    """bitflip: one byte in the middle inverted; truncate: the second half cut; garbage: random bytes, same size."""
    data = bytearray(Path(path).read_bytes())
    if how == "bitflip":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncate":
        del data[len(data) // 2:]
    elif how == "garbage":
        data = bytearray(random.Random(seed).randbytes(len(data)))
    else:
        raise ValueError(f"corrupt how={how!r}: one of bitflip, truncate, garbage")
    Path(path).write_bytes(bytes(data))
