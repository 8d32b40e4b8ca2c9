"""The smallest memory family, added the way docs/architecture.md ("A memory family") says:
its module, its family object, and the run's settings. Nothing in train/, optim/, run/ or
distributed/ names it, yet it trains, checkpoints and resumes, fine-tunes alone with
finetune=memory (its table is a sparse table) and exports."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_paths import check_family_paths
from torch import nn

from memlm.memory.tables import CATEGORY
from memlm.model import family as family_module
from memlm.model.family import Family

KIND = "example_rows"


class RowTable(nn.Module):
    """A sparse table: each row gets a gradient only when a token reads it (memlm.memory.tables)."""

    param_category = CATEGORY

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))


class RowFFN(nn.Module):
    """Each token reads the one row its key scores best, scaled by that score's softmax weight."""

    def __init__(self, dim: int, rows: int):
        super().__init__()
        self.keys = nn.Linear(dim, rows, bias=False)
        self.table = RowTable(rows, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, dim) -> (batch, seq, dim)
        scores = self.keys(x)  # (batch, seq, rows)
        row = scores.argmax(-1)  # (batch, seq)
        weight = scores.softmax(-1).gather(-1, row[..., None])  # (batch, seq, 1)
        return weight * F.embedding(row, self.table.weight)

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.keys.weight, std=init_std, a=-3 * init_std, b=3 * init_std)
        nn.init.normal_(self.table.weight, std=out_std)

    def flops_per_token(self) -> int:
        return 2 * self.keys.in_features * self.keys.out_features + 2 * self.keys.in_features


class RowFamily(Family):
    kind, label = KIND, "Rows"
    holds_tables = True

    def build(self, ctx) -> nn.Module:
        return RowFFN(ctx.args.dim, rows=32)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(family_module._FAMILIES, KIND, RowFamily())


RUN = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "logging.every=1",
       "logging.wandb.mode=disabled", f"memory.kind={KIND}", "memory.layers=[1]", "val_batches=0"]


def test_trains_resumes_fine_tunes_and_exports(registered, tmp_path, capsys):
    def inspect(trainer):
        assert [type(m) for m in trainer.model.modules() if isinstance(m, RowTable)] == [RowTable]
        assert {g["name"] for g in trainer.optimizer.param_groups} >= {"memory_values"}  # its table's own group

    check_family_paths(RUN, tmp_path, inspect)
    # the folder the export ends up in, not the temporary one it was written into
    assert f"no Hugging Face modeling code (hf/remote/): {tmp_path / 'export'} loads with memlm" \
        in capsys.readouterr().out
