"""Counting the step's host reads: the Tensor methods that bring a value to
the host, patched while `Trainer.fit` runs (tests/integration/test_step_sync.py,
test_moe_step_sync.py)."""

from __future__ import annotations

import threading
import traceback

import torch

from memlm.train.trainer import Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "data.kind=random",
        "logging.wandb.mode=disabled", "checkpoint.at_end=false", "val_batches=0"]
MEMPLUS = ["memory=memplus", "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16",
           "memory.heads=2", "memory.layers=[1]"]
MOE = ["memory=moe", "memory.layers=[1]", "memory.n_experts=4", "memory.top_k=2"]

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# The reads allowed: memory/fast/ops.py checks read indices, and memory/engram_hash.py an
# Engram layer's token ids, on the host on CPU only; on CUDA the same checks are
# torch._assert_async (no sync).
ALLOWED = (("memory/fast/ops.py", "_check_indices"), ("memory/engram_hash.py", "_check_tokens"))


def allowed(read: str) -> bool:
    """Whether a host read (its caller's line) is one of the ALLOWED checks."""
    return any(all(part in read for part in site) for site in ALLOWED)


def count_host_reads(trainer: Trainer, monkeypatch) -> list[tuple[int, str]]:
    """(trainer step at the read, caller) for every host read during fit()
    after its first train_step began, from any thread."""
    reads: list[tuple[int, str]] = []
    started = threading.Event()
    busy = threading.local()
    train_step = trainer.train_step

    def marked_train_step(*args, **kwargs):
        started.set()
        return train_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", marked_train_step)
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if started.is_set() and not getattr(busy, "on", False):
                busy.on = True  # reads inside this one (e.g. by the formatting below) are not new ones
                try:
                    frame = traceback.extract_stack(limit=2)[0]  # the caller of the read
                    reads.append((trainer.step, f"{_name} at {frame.filename}:{frame.lineno} ({frame.name})"))
                finally:
                    busy.on = False
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    trainer.fit()
    monkeypatch.undo()
    return reads
