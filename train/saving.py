"""The checkpointer on the training loop: it knows when to save (memlm.checkpoint.checkpointer).

    saving = Saving(checkpointer, state)   # state(): the TrainingState to write, made when a save is due
    saving.step_end(step, run)             # checkpoint.every: run.saved is the checkpoint written, or None
    saving.end(step, run)                  # the last step's save (checkpoint.at_end)
    saving.close()                         # a background save lands before the run is said to have ended
"""

from __future__ import annotations

from collections.abc import Callable

from memlm.checkpoint.checkpointer import Checkpointer, TrainingState


class Saving:
    def __init__(self, checkpointer: Checkpointer, state: Callable[[], TrainingState]):
        self.checkpointer, self.state = checkpointer, state

    def step_end(self, step: int, run) -> None:
        run.saved = self.checkpointer.maybe_save(step, self.state)

    def end(self, step: int, run) -> None:
        run.saved = self.checkpointer.maybe_save(step, self.state, last=True)

    def close(self) -> None:
        self.checkpointer.finalize()
