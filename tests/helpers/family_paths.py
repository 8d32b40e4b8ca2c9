"""A memory family's whole path through the house, for one family's tests
(tests/integration/test_example_family.py, test_ultramem_family.py, test_engram_model.py):

    export_dir = check_family_paths(run, tmp_path, inspect=lambda trainer: ...)

1. trains `run` for 4 steps (`inspect` sees the trainer before it fits);
2. stops the same run after 2 steps and resumes it: the losses equal the uninterrupted run's;
3. fine-tunes the checkpoint with finetune=memory: the family's sparse tables move, nothing else;
4. exports the checkpoint: the export's logits equal the checkpoint's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from memlm.config.run import compose
from memlm.memory.tables import sparse_tables


def losses(run: Path) -> list[float]:
    """The training losses a run folder's metrics.jsonl holds, by step."""
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def check_family_paths(run: list[str], tmp_path: Path, inspect: Callable = lambda trainer: None) -> Path:
    from memlm.hf import from_pretrained
    from memlm.run.export import export
    from memlm.run.load import load_model
    from memlm.train.trainer import Trainer

    full = tmp_path / "full"
    trainer = Trainer(compose([*run, "steps=4", f"dump_dir={full}"]))
    inspect(trainer)
    trainer.fit()
    halves = tmp_path / "halves"
    Trainer(compose([*run, "steps=4", f"dump_dir={halves}"])).fit(stop_after=2)
    Trainer(compose([*run, "steps=4", f"dump_dir={halves}", "resume=auto"])).fit()
    assert losses(halves) == losses(full)  # resumed bit for bit

    (ckpt,) = (full / "checkpoints").glob("step_*4")
    base = load_model(ckpt).model.state_dict()
    tuned = Trainer(compose([*run, "steps=2", "finetune=memory", "memory.value_lr=0.1", f"init_from={ckpt}",
                             f"dump_dir={tmp_path / 'tuned'}"]))
    tuned.fit()
    tables = {id(p) for p in sparse_tables(tuned.model)}
    assert tables
    for name, p in tuned.model.named_parameters():
        moved = not torch.equal(p.detach(), base[name])
        assert moved == (id(p) in tables), name  # finetune=memory trains the family's tables alone

    out = export(ckpt, tmp_path / "export")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_pretrained(out)(tokens), load_model(ckpt).model(tokens))
    return out


def sparse_finetune_steps(run: list[str], ckpt: Path, top_t: int, dump: Path, steps: int = 2) -> list[dict]:
    """Fine-tune `ckpt` with finetune=sparse (top_t rows, SGD at value lr 10, so every kept row moves)
    for `steps` steps, one at a time: for each step, {state-dict name: the rows that changed} of every
    tensor the step moved (a row: an index along dim 0; a 0-d tensor has the one row 0)."""
    from memlm.train.trainer import Trainer

    trainer = Trainer(compose([*run, "finetune=sparse", f"finetune.top_t={top_t}", "finetune.optimizer=sgd",
                               "memory.value_lr=10", f"init_from={ckpt}", f"steps={steps}", f"dump_dir={dump}"]))
    changes = []
    try:
        for _ in range(steps):
            before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            trainer.train_step()
            after = trainer.model.state_dict()
            changes.append({k: _changed_rows(before[k], after[k]) for k in after
                            if not torch.equal(after[k], before[k])})
    finally:
        trainer.close()
    return changes


def _changed_rows(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    differs = (after != before).reshape(after.shape[0] if after.dim() else 1, -1)  # (rows, rest)
    return set(differs.any(1).nonzero().flatten().tolist())
