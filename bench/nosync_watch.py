"""The nosync section's instruments (bench/device_train.py nosync): every Tensor method that brings a value
to the host, counted while armed, and a training run watched step by step.

    with HostReadCounter(cuda=False) as reads:   # or cuda=True: only reads of CUDA tensors
        reads.armed = True; ...; reads.armed = False
    watch_fit(trainer, cuda)   # trainer.fit() with its non-logging steps watched -> {"steps", "syncs", "n_syncs"}
"""

from __future__ import annotations

import threading
import traceback

import torch

from memlm.train.trainer import Trainer

# Tensor methods that bring a value to the host (a sync when the tensor is on a GPU).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# memory/fast/ops.py checks read indices on the host on CPU only; on CUDA the same
# check is torch._assert_async (no sync).
CPU_ONLY_READS = (("memory/fast/ops.py", "_check_indices"),)


class HostReadCounter:
    """While armed, records every call of a Tensor method that brings a value
    to the host (HOST_READS), with its caller. With cuda=True only reads of
    CUDA tensors count (a CPU tensor's read is no device sync); on CPU every
    read counts except CPU_ONLY_READS. From any thread.

        with HostReadCounter(cuda=False) as reads:
            reads.armed = True; ...; reads.armed = False
        reads.reads  # [(label, "item at file:line (function)"), ...]
    """

    def __init__(self, cuda: bool):
        self.cuda, self.armed, self.label = cuda, False, ""
        self.reads: list[tuple[str, str]] = []
        self._saved: dict = {}
        self._busy = threading.local()

    def __enter__(self) -> HostReadCounter:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counted(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _counted(self, name, original):
        counter = self

        def counted(tensor, *args, **kwargs):
            if counter.armed and not getattr(counter._busy, "on", False):
                counter._busy.on = True  # reads made while recording are not new ones
                try:
                    counter._record(name, tensor)
                finally:
                    counter._busy.on = False
            return original(tensor, *args, **kwargs)

        return counted

    def _record(self, name: str, tensor: torch.Tensor) -> None:
        if self.cuda and tensor.device.type != "cuda":
            return
        frame = traceback.extract_stack(limit=3)[0]  # the caller of the read
        where = f"{frame.filename}:{frame.lineno} ({frame.name})"
        if not self.cuda and any(f in frame.filename and fn == frame.name for f, fn in CPU_ONLY_READS):
            return
        self.reads.append((self.label, f"{name} at {where}"))


def watch_fit(trainer: Trainer, cuda: bool) -> dict:
    """trainer.fit() with every non-logging step watched, from its start until
    the next step starts (the loop's own per-step work included): host reads
    counted (HostReadCounter) and, on a GPU from the third step on,
    torch.cuda.set_sync_debug_mode("error"). Logging steps are not watched."""
    step, syncs = trainer.train_step, []

    with HostReadCounter(cuda) as reads:
        def watched(*args, **kwargs):
            logging_step = kwargs.get("read", args[0] if args else True)
            label = f"step {trainer.step + 1}"
            reads.armed, reads.label = not logging_step, label
            if cuda:
                torch.cuda.set_sync_debug_mode("default" if logging_step or trainer.step < 2 else "error")
            try:
                return step(*args, **kwargs)
            except RuntimeError as err:
                syncs.append(f"{label}: {str(err).splitlines()[0]}")
                raise

        trainer.train_step = watched
        try:
            trainer.fit()
        except RuntimeError as err:  # a sync in the loop's own per-step work, outside train_step
            if not syncs:
                syncs.append(f"after step {trainer.step}: {str(err).splitlines()[0]}")
        finally:
            reads.armed = False
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    found = [f"{label}: {read}" for label, read in reads.reads] + syncs
    return {"steps": trainer.step, "syncs": found[:5], "n_syncs": len(found)}
