"""One run owns its dump_dir: a file lock held for the run's life.

    lock = RunLock.acquire(dump_dir)     # raises RunLockedError naming the holder
    ...                                  # train, save, prune, write metrics
    lock.release()

The lock is `fcntl.flock` on `dump_dir/run.lock`, taken by the main process
(rank 0 under torchrun) before it touches anything in the directory. The file
names the holder (host, PID, start time) so a second run can say who has it.
The kernel drops an flock when its process dies, however it dies, so a lock
file whose lock is free was left by a run that ended without releasing it: it
is taken over with a warning. A clean release empties the file first, so the
next run starts without that warning. The file itself is never deleted:
unlinking a lock file lets two later runs lock two different files.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from memlm.errors import MemlmError
from memlm.files import RUN_LOCK

LOCK_NAME = RUN_LOCK


class RunLockedError(MemlmError, RuntimeError):
    """Another live run holds the dump_dir."""


def _describe(holder: dict) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"started {holder.get('started', '?')}")


def _read_holder(fh) -> dict:
    fh.seek(0)
    text = fh.read()
    try:
        holder = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        holder = {"unreadable": text[:200]}
    return holder if isinstance(holder, dict) else {"unreadable": text[:200]}


class RunLock:
    def __init__(self, path: Path, fh):
        self.path = path
        self._fh = fh

    @classmethod
    def acquire(cls, dump_dir: str | Path) -> RunLock:
        path = Path(dump_dir) / LOCK_NAME
        fh = open(path, "a+")  # never truncates: the holder's record must survive our attempt
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fh)
            fh.close()
            raise RunLockedError(
                f"dump_dir {path.parent} is in use by another run ({_describe(holder)}; lock file {path}). "
                f"Wait for that run to finish, stop it, or choose another dump_dir."
            ) from None
        except BaseException:
            fh.close()
            raise
        previous = _read_holder(fh)
        if previous:
            print(f"[train] warning: taking over the stale lock {path} of a run that ended without "
                  f"releasing it ({_describe(previous)})", flush=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
        return cls(path, fh)

    def release(self) -> None:
        """Empty the record (a clean end) and drop the lock; safe to call twice."""
        if self._fh is None:
            return
        fh, self._fh = self._fh, None
        try:
            fh.seek(0)
            fh.truncate()
            fh.flush()
        finally:
            fh.close()  # closing the descriptor drops the flock


def lock_run_dir(dump_dir: Path, is_main: bool, distributed: bool, device) -> RunLock | None:
    """Rank 0 takes the lock; every rank learns whether it did, so a refused
    torchrun job stops on all ranks at once. Returns the lock (rank 0) or None."""
    import torch
    import torch.distributed as dist

    lock, error = None, None
    if is_main:
        try:
            lock = RunLock.acquire(dump_dir)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = err
    if distributed:
        failed = torch.tensor([0 if error is None else 1], device=device)
        dist.broadcast(failed, src=0)
        if failed.item() and error is None:
            raise RunLockedError(f"dump_dir {dump_dir} is in use by another run: rank 0 could not lock "
                                 f"{Path(dump_dir) / LOCK_NAME} (its error names the holder)")
    if error is not None:
        raise error
    return lock
