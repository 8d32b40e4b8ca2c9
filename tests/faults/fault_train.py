"""`python -m memlm.train` that SIGKILLs itself at a named point of one save (MEMLM_FAULT_KILL_AT=point:step).

    MEMLM_FAULT_KILL_AT=rename:8 python tests/faults/fault_train.py <overrides>

Points, in the order a save passes them (memlm.checkpoint.checkpointer):

    begin    the temporary folder exists, no shard written yet
    shards   DCP wrote every shard into .tmp_step_N, no meta.json yet
    meta     meta.json (with the manifest) is in .tmp_step_N, not yet renamed
    rename   .tmp_step_N was renamed to step_N, `latest` still names the previous one
    latest   `latest` names step_N, older checkpoints not yet pruned

The points are found by watching the save's file operations (DCP's save and
os.replace onto the paths above), so the checkpoint code carries no test hook.
A point the save never passes is not an error here: the run then finishes, and
the harness fails the test because the process was not killed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

POINTS = ("begin", "shards", "meta", "rename", "latest")


def _die(point: str, step: int) -> None:
    print(f"[fault] SIGKILL at {point} of the save of step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    name = f"step_{step:08d}"
    real_save, real_replace = dcp.save, os.replace

    def save(*args, **kwargs):
        ours = Path(str(kwargs.get("checkpoint_id", ""))).name == f".tmp_{name}"
        if ours and point == "begin":
            _die(point, step)
        out = real_save(*args, **kwargs)
        if ours and point == "shards":
            _die(point, step)
        return out

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        dst = Path(dst)
        if (point == "meta" and dst.name == "meta.json" and dst.parent.name == f".tmp_{name}"
                or point == "rename" and dst.name == name and Path(src).name == f".tmp_{name}"
                or point == "latest" and dst.name == "latest" and dst.read_text().strip() == name):
            _die(point, step)

    dcp.save = save
    os.replace = replace


if __name__ == "__main__":
    point, _, step = os.environ["MEMLM_FAULT_KILL_AT"].partition(":")
    if point not in POINTS or not step.isdigit():
        sys.exit(f"MEMLM_FAULT_KILL_AT={point}:{step}: expected POINT:STEP with POINT one of {', '.join(POINTS)}")
    install(point, int(step))
    from memlm.train.cli import main

    sys.exit(main(sys.argv[1:]))
