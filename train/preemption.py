"""Stop a training run cleanly when the cluster is about to take its nodes away.

The Slurm job of memlm.launch.slurm forwards its preemption signal (SIGUSR1
by default, sent `--signal-seconds` before the time limit) to every rank, and
Slurm sends SIGTERM to every process of a job it ends (time limit, preemption
with a grace time, scancel); torchrun forwards both. Either one stops the run
after a checkpoint (PREEMPTION_SIGNALS). Checkpointing inside the signal handler itself would
interleave the checkpoint's collectives with whatever collective the rank was
in (a deadlock), and ranks receive the signal at slightly different moments.
So the handler only sets a flag, and the training loop asks at agreed steps
(the trainer: every logging step, so a non-logging step has no collective
and no host read for it; on one process every step, which costs nothing):

    from memlm.train.preemption import install_preemption_handler

    preemption = install_preemption_handler(self.save_checkpoint)   # in Trainer.fit, before the loop
    while self.step < last_step:
        ...one optimizer step, logging, periodic checkpoint...
        if logging_step and preemption.check():  # collective: every rank, at the same steps
            break               # the checkpoint is written; leave fit() and exit the process
    preemption.uninstall()      # in a finally: restore the previous handlers

On the trainer's loop (memlm.train.extensions) the handler does this itself:
`step_end(step, run)` checks at the steps whose metrics were read (run.read)
and sets `run.stop`; `close()` uninstalls.

`check()` all-reduces the flag (MAX over the default process group), so every
rank stops after the same step even if only one of them got the signal, then
runs the callback once on every rank (the checkpoint is collective too).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence

# The signals a training run checkpoints and stops on (the trainer's handler).
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionHandler:
    def __init__(self, callback: Callable[[], object] | None, signals: Sequence[signal.Signals]):
        self.callback = callback
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None  # the first signal this process got
        self.stopped = False  # check() has returned True (and run the callback)
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.signals}

    def _on_signal(self, signum: int, frame) -> None:
        # Only a flag: the handler may run in the middle of a collective or a
        # print, where doing real work (or even printing) is unsafe.
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """Whether this process received one of the signals (no communication)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Whether any rank received a signal. Collective when a process group
        with more than one rank is initialized: every rank must call it at the
        same point of the loop."""
        import torch
        import torch.distributed as dist

        from memlm.ranks import collective_device, many_ranks

        if not many_ranks():
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def check(self) -> bool:
        """Call on every rank at the same steps. True (after running the callback
        once) when the run should stop; later calls return True without communicating."""
        if self.stopped:
            return True
        if not self.should_stop():
            return False
        self.stopped = True
        _print_main(f"[preemption] {self.received.name if self.received else 'a signal on another rank'}: "
                    "writing a checkpoint and stopping; the next attempt resumes with resume=auto")
        if self.callback is not None:
            self.callback()
        return True

    def step_end(self, step: int, run) -> None:
        """Last on the loop's step: a stop asked for is agreed, saved and recorded in `run.stop`.
        Collective on several ranks, so only at the steps whose metrics were read (every rank
        reaches the same ones); logging.every bounds how late a signal is seen."""
        from memlm.ranks import many_ranks

        if (run.read or not many_ranks()) and self.check():
            run.stop = True

    def close(self) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        """Restore the handlers that were installed before."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def install_preemption_handler(callback: Callable[[], object] | None = None,
                               signals: Sequence[signal.Signals] = PREEMPTION_SIGNALS) -> PreemptionHandler:
    """Catch `signals` (default SIGUSR1 and SIGTERM) from now on; returns the
    handler whose `check()` the training loop calls at agreed steps. Must be
    called from the main thread (Python delivers signals only there).

    While it is installed a SIGTERM no longer ends the process at once: the
    run stops after the step it is in (at the next agreed step on several
    ranks). A rank blocked in a collective whose peer is gone only sees it when
    that collective fails, or is killed after the launcher's grace time
    (torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT; Slurm: KillWait)."""
    return PreemptionHandler(callback, signals)


def _print_main(message: str) -> None:
    from memlm.ranks import group_rank

    if group_rank() == 0:
        print(message, flush=True)
