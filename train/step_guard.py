"""Skip non-finite steps on the device; read step statistics on the host only when asked.

    ok = step_ok(loss, grad_norm, value_grad_norm)     # (,) bool on the device
    step_if_finite(optimizer, ok)                      # no change at all when not ok
    guard = StepGuard(max_nonfinite_steps, print, lower=lower_hint(mode_of(cfg), cfg))
    guard.record(step, lr, loss, grad_norm, value_grad_norm, ok)
    ...
    metrics = guard.read()   # at logging / checkpoint / last steps: the one host read

A step whose loss or gradient norm (dense or memory-value group) is not
finite must change nothing: not the weights, not AdamW's moments, not its
step count. Deciding that on the host would read a device value every step
(a sync that stalls a GPU's queue), so the decision stays on the device: the
optimizer gets a `found_inf` tensor, the mechanism torch's fused AdamW already
has for loss scaling (the kernel leaves parameters and moments untouched and
takes the step count back when it is 1), and memlm's SparseRowAdamW
implements the same attribute.

The host learns which steps were skipped at the next read (a logging,
checkpoint, evaluation or final step; `Trainer.fit` reads before every save).
Each skipped step then gets the console line it always had, is counted, and
the stop rule (`max_nonfinite_steps` consecutive skipped steps ->
NonFiniteLossError) is applied in step order. The run may thus stop a few
steps after the N-th consecutive skip rather than at it: those extra steps
were either skipped too (no change) or trained normally, and no checkpoint
is written before the check.
"""

from __future__ import annotations

import math

import torch

from memlm.errors import MemlmError


class NonFiniteLossError(MemlmError, RuntimeError):
    """The loss stayed NaN/inf for train.max_nonfinite_steps steps in a row (the message says what to lower)."""


def lower_hint(mode, cfg) -> str:
    """The learning rates a run of `cfg` trains with, as the stop names them: "memory.value_lr (now 300:
    what finetune=memory trains with)" (`mode`: memlm.finetune.modes.mode_of(cfg))."""
    named = " or ".join(f"{key} (now {value:g}" for key, value in mode.lr_settings(cfg).items())
    return f"{named}: what finetune={mode.name} trains with)"


def step_ok(*values: torch.Tensor) -> torch.Tensor:
    """(,) bool device tensor: every value is finite (no host read)."""
    return torch.stack([torch.isfinite(v.detach().float()).all() for v in values]).all()


def step_if_finite(optimizer: torch.optim.Optimizer, ok: torch.Tensor) -> None:
    """optimizer.step() that is a no-op when `ok` is False, decided on the device.

    The optimizer must honour `found_inf` (torch's fused AdamW; SparseRowAdamW);
    one that would silently ignore it is refused."""
    if isinstance(optimizer, torch.optim.AdamW) and not optimizer.defaults.get("fused"):
        raise TypeError("step_if_finite needs AdamW(fused=True): only the fused kernel honours found_inf")
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise TypeError(f"{type(optimizer).__name__} does not support found_inf (skipping a step on the device)")
    optimizer.found_inf = (~ok).float()  # 1.0 -> the kernel skips the update
    try:
        optimizer.step()
    finally:
        # Left set, it would also gate later steps (e.g. DCP's optimizer-state init).
        del optimizer.found_inf


class StepGuard:
    """Per-step statistics kept on the device until `read()`, and the
    non-finite bookkeeping applied when they reach the host."""

    def __init__(self, max_nonfinite_steps: int, announce, nonfinite_total: int = 0, lower: str = "optim.lr"):
        self.max_nonfinite_steps = max_nonfinite_steps
        self.announce = announce  # called with each console line (the main rank prints)
        self.lower = lower  # what the stop tells the user to lower: the learning rates the run trains with
        self.nonfinite_total = nonfinite_total
        self.nonfinite_run = 0  # consecutive skipped steps, as of the last read
        self._skipped_unreported = 0  # skipped steps since the last metrics report
        self._steps: list[tuple[int, float]] = []  # (step, lr) of the unread steps: host values
        self._rows: list[torch.Tensor] = []  # (4,) per unread step: loss, grad_norm, value_grad_norm, ok

    def record(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor,
               value_grad_norm: torch.Tensor, ok: torch.Tensor) -> None:
        self._steps.append((step, lr))
        device = loss.device
        row = [t.detach().float().to(device).reshape(()) for t in (loss, grad_norm, value_grad_norm, ok)]
        self._rows.append(torch.stack(row))

    def read(self, report: bool = True) -> dict[str, float]:
        """Bring the unread steps to the host (one read), count and announce the
        skipped ones, apply the stop rule; return the last step's metrics
        ({} when nothing is unread). `skipped` is the number of skipped steps
        since the previous report, present when it is not 0; `report=False`
        (a read before a save) leaves that window open."""
        if not self._rows:
            return {}
        rows = torch.stack(self._rows).tolist()  # the host read
        steps, self._steps, self._rows = self._steps, [], []
        for (step, _), (loss, gnorm, vnorm, ok) in zip(steps, rows):
            if ok:
                self.nonfinite_run = 0
                continue
            self._skipped_unreported += 1
            self.nonfinite_total += 1
            self.nonfinite_run += 1
            cause = (f"non-finite loss {loss}" if not math.isfinite(loss) else
                     f"non-finite gradient norm (dense {gnorm}, memory values {vnorm}) at loss {loss:.4f}")
            self.announce(f"[train] step {step}: {cause}, step skipped ({self.nonfinite_total} skipped so far)")
            if self.nonfinite_run >= self.max_nonfinite_steps:
                raise NonFiniteLossError(
                    f"{self.nonfinite_run} consecutive non-finite losses or gradient norms (last at step {step}, "
                    f"read at step {steps[-1][0]}); stopping. Lower {self.lower}, check the data, "
                    "or raise max_nonfinite_steps."
                )
        loss, gnorm, vnorm, _ = rows[-1]
        metrics = {"loss": loss, "lr": steps[-1][1], "grad_norm": gnorm, "value_grad_norm": vnorm}
        if report:
            if self._skipped_unreported:
                metrics["skipped"] = float(self._skipped_unreported)
            self._skipped_unreported = 0
        return metrics
