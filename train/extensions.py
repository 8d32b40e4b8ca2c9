"""The training loop's declared points, and what its components share.

The loop knows no component by name and does no timing arithmetic: each
component (logging, validation, saving, evaluation, slot usage, profiling,
preemption, a fine-tune mode's step hook, a memory family's step needs) is an
object with some of the points below, and decides for itself whether a step
is its step.

    class Announce:                                  # any object with some of the points
        def step_end(self, step: int, run: RunRecord) -> None:
            if step % 100 == 0:
                print(f"step {step}, loss {run.metrics.get('loss')}")

    trainer = Trainer(cfg)
    trainer.extensions.add(Announce())
    trainer.fit()

Points, in the order the loop reaches them:
- `step_start(step)`: before the step's first forward (`step` counts from 1:
  the step about to run).
- `before_forward(inputs)`: each micro-batch's input tokens (B, T), still on
  the host, before they go to the device and the forward runs.
- `after_backward()`: the last micro-batch's backward is done; before the
  gradients are clipped and the optimizer steps.
- `step_end(step, run)`: after the optimizer step; a component acts when it
  is due and records what it produced in `run`.
- `end(step, run)`: the run reached its last step (not after a preemption).
- `close()`: always, last, in the order the components were added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POINTS = ("step_start", "before_forward", "after_backward", "step_end", "end", "close")


@dataclass
class RunRecord:
    """What the loop's components produce and read, step by step."""

    last_step: int  # the step this fit() stops at (steps=, or an earlier stop_after)
    read: bool = False  # this step's metrics were read on the host (a logging step: collectives agree)
    metrics: dict[str, float] = field(default_factory=dict)  # the last metrics read on the host
    val_loss: float | None = None
    evals: dict[str, Any] = field(default_factory=dict)
    saved: Path | None = None  # the checkpoint this step wrote (None: none)
    stop: bool = False  # a component asked the loop to stop after this step (a preemption)


class Extensions:
    """The components on the loop's points; each point calls them in the order they were added."""

    def __init__(self, *components: object):
        self.components: list[object] = []
        for component in components:
            self.add(component)

    def add(self, component: object) -> None:
        if not any(callable(getattr(component, point, None)) for point in POINTS):
            raise TypeError(f"{type(component).__name__} has none of the loop's points: {', '.join(POINTS)}")
        self.components.append(component)

    def _call(self, point: str, *args: Any) -> None:
        for component in self.components:
            if (method := getattr(component, point, None)) is not None:
                method(*args)

    def step_start(self, step: int) -> None:
        self._call("step_start", step)

    def before_forward(self, inputs: Any) -> None:
        self._call("before_forward", inputs)

    def after_backward(self) -> None:
        self._call("after_backward")

    def step_end(self, step: int, run: RunRecord) -> None:
        self._call("step_end", step, run)

    def end(self, step: int, run: RunRecord) -> None:
        self._call("end", step, run)

    def close(self) -> None:
        """Every component's close, even when one of them fails (the first failure is raised after)."""
        failure: BaseException | None = None
        for component in self.components:
            if (method := getattr(component, "close", None)) is not None:
                try:
                    method()
                except BaseException as err:  # noqa: BLE001 - the others still release what they hold
                    failure = failure or err
        if failure is not None:
            raise failure
