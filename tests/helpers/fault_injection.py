"""Faults injected into a Trainer from a test, by patching its instance (the
trainer carries no test-only parameters)."""

from __future__ import annotations

from pathlib import Path

import torch


def nonfinite_loss_at(trainer, steps: set[int]) -> None:
    """Make the loss of these steps (1-based) NaN, every micro-batch of them."""
    forward = trainer._forward_loss

    def poisoned(*args, **kwargs):
        loss = forward(*args, **kwargs)
        return loss * float("nan") if trainer.step + 1 in steps else loss

    trainer._forward_loss = poisoned


def nan_grad_at(trainer, params_by_step: dict[int, str]) -> None:
    """Fill one named parameter's gradient with NaN at these steps (1-based):
    after the backward and the value-gradient reduction, before the clip."""
    reduction = trainer.value_grads
    finish = reduction.finish
    params = dict(trainer.model.named_parameters())
    for name in params_by_step.values():
        if name not in params:
            raise KeyError(f"nan_grad_at: no parameter {name!r}; valid: {', '.join(params)}")

    def finish_then_poison() -> None:
        finish()
        name = params_by_step.get(trainer.step + 1)
        if name is not None:
            grad = params[name].grad
            with torch.no_grad():
                (grad._values() if grad.is_sparse else grad).fill_(float("nan"))

    reduction.finish = finish_then_poison


def corrupt_shard(step_dir: Path) -> None:
    """Flip one byte in the middle of rank 0's first DCP shard of a checkpoint."""
    shard = next(step_dir.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
