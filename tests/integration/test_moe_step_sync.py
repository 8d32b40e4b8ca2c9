"""MoE in a single-process bf16 training step (autocast): no host read in a
non-logging step, and the experts run as grouped GEMMs on bf16 inputs.

The host-read counter is tests/integration/test_step_sync.py's (Tensor methods that bring
a value to the host, patched while `Trainer.fit` runs); here the run uses
parallel.dtype=bf16, so the trainer wraps forward and loss in
torch.autocast(bf16) as it does on one GPU.

    python -m pytest -q tests/integration/test_moe_step_sync.py
"""

from __future__ import annotations

import torch
from host_reads import BASE, MOE, allowed, count_host_reads

from memlm.config.run import compose
from memlm.model.moe import GROUPED, MoE
from memlm.train.trainer import Trainer

AUTOCAST_BF16 = ["parallel.dtype=bf16", "device=cpu", "parallel.memory_parallel=1"]


def _record_paths(monkeypatch) -> list[tuple[str, torch.dtype]]:
    calls = []
    grouped = MoE.experts_grouped

    def spy(self, x, *args):
        calls.append((GROUPED, x.dtype))
        return grouped(self, x, *args)

    monkeypatch.setattr(MoE, "experts_grouped", spy)
    return calls


def test_no_host_read_in_non_logging_moe_steps_under_autocast_bf16(tmp_path, monkeypatch):
    steps = 5
    trainer = Trainer(compose([*BASE, *MOE, *AUTOCAST_BF16, f"steps={steps}", "logging.every=1000",
                               f"dump_dir={tmp_path}"]))
    ctx = trainer._autocast()
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16  # the one-GPU setting
    calls = _record_paths(monkeypatch)
    reads = count_host_reads(trainer, monkeypatch)
    in_steps = [r for s, r in reads if s < steps - 1 and not allowed(r)]
    assert in_steps == [], "host reads in non-logging steps:\n" + "\n".join(in_steps)
    assert any(s >= steps - 1 for s, _ in reads)  # the counter sees the logging step's reads
    # Every MoE forward of the run: the grouped GEMMs, in bf16 (one MoE layer, one per step).
    assert calls and set(calls) == {(GROUPED, torch.bfloat16)}, set(calls)


def test_the_counter_sees_a_per_expert_host_read(tmp_path, monkeypatch):
    """The old per-expert loop read the counts with .tolist() in every step:
    put such a read back and the counter reports it."""
    steps = 4
    trainer = Trainer(compose([*BASE, *MOE, *AUTOCAST_BF16, f"steps={steps}", "logging.every=1000",
                               f"dump_dir={tmp_path}"]))
    grouped = MoE.experts_grouped

    def with_read(self, x, gates, experts, counts):
        counts.tolist()
        return grouped(self, x, gates, experts, counts)

    monkeypatch.setattr(MoE, "experts_grouped", with_read)
    reads = count_host_reads(trainer, monkeypatch)
    assert any(s < steps - 1 and "tolist" in r and "with_read" in r for s, r in reads), reads
