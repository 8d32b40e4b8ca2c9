"""The fine-tune modes (memlm.finetune.modes): what each refuses, one line naming the key,
the value and what is valid; what each trains; and that no code outside the component
branches on a mode's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli import run_main

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.finetune.modes import MODES, mode_of
from memlm.model import Transformer

MEMPLUS = ["model.vocab_size=128", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "memory=memplus",
           "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16",
           "memory.heads=2"]


def test_finetune_memory_of_a_model_without_value_tables_is_one_line(tmp_path, capsys):
    proc = run_main("memlm.train", "memory=moe", "memory.layers=[1]", "finetune=memory", "logging.wandb.mode=disabled",
                    f"dump_dir={tmp_path / 'run'}", capsys=capsys)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid config value finetune.mode='memory': ")
    assert "memory.kind=moe, which has no value tables" in lines[0] and "memory, memplus, peer" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode,override,readers", [
    ("memory", "finetune.top_t=500", "sparse"),
    ("memory", "finetune.ranking=tfidf", "sparse"),
    ("full", "finetune.background=bg.safetensors", "sparse"),
    ("sparse", "finetune.lora_rank=4", "lora"),
    ("lora", "finetune.optimizer=sgd", "memory or sparse"),
])
def test_a_setting_the_mode_ignores_is_refused_naming_who_reads_it(mode, override, readers):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=re.escape(f"{key}=") + ".*" + re.escape(
            f"with finetune.mode={mode}, which ignores it (finetune.mode={readers} reads it)")) as err:
        compose([*MEMPLUS, f"finetune={mode}", override, "finetune.top_t=5" if mode == "sparse" else "seed=0"])
    assert str(err.value.value) == value


def test_top_t_above_the_slot_count_is_refused():
    with pytest.raises(ConfigError, match=re.escape("finetune.top_t=65: at most the table's 64 rows")):
        compose([*MEMPLUS, "finetune=sparse", "finetune.top_t=65"])
    assert compose([*MEMPLUS, "finetune=sparse", "finetune.top_t=64"]).finetune.top_t == 64


def test_a_saved_config_that_set_an_ignored_setting_stays_readable():
    """Refusing ignored settings is for what a user composes: a finished run's config.yaml loads."""
    from memlm.config.run import from_yaml, to_yaml

    cfg = compose([*MEMPLUS, "finetune=memory"])
    cfg.finetune.background = "old/slot_usage.safetensors"  # as the study's earlier rounds recorded it
    assert from_yaml(to_yaml(cfg)).finetune.background == "old/slot_usage.safetensors"


def test_full_settings_that_differ_only_in_the_value_lr_read_differently():
    """Full fine-tuning trains the value tables at memory.value_lr, which optim.lr does not lower: a study's
    report keys settings by these words, so two value rates must not read as one setting."""
    def setting(*overrides):
        cfg = compose([*MEMPLUS, "finetune=full", "optim.lr=1e-5", *overrides])
        return mode_of(cfg).describe(cfg)
    assert setting("memory.value_lr=1e-3") == "AdamW lr 1e-05, values lr 0.001"
    assert setting("memory.value_lr=3e-2") == "AdamW lr 1e-05, values lr 0.03"
    dense = compose(["model.vocab_size=128", "model.dim=32", "model.n_layers=2", "model.n_heads=2",
                     "finetune=full", "optim.lr=1e-5"])
    assert mode_of(dense).describe(dense) == "AdamW lr 1e-05"  # no value tables: one rate


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_trains_what_it_says(mode):
    cfg = compose([*MEMPLUS, f"finetune={mode}", "finetune.top_t=5" if mode == "sparse" else "seed=0"])
    model = Transformer(cfg.model, cfg.memory)
    mode_of(cfg).adapt(model, cfg)
    mode_of(cfg).freeze(model)
    trained = {k for k, p in model.named_parameters() if p.requires_grad}
    expected = {
        "full": {k for k, _ in model.named_parameters()},
        "memory": {"shared.memory_values.weight"},
        "sparse": {"shared.memory_values.weight"},
        "lora": {k for k, _ in model.named_parameters() if ".lora." in k},
    }[mode]
    assert trained == expected and trained


ROOT = Path(__file__).resolve().parents[2]
BRANCH = re.compile(r"""finetune\.mode\s*(==|!=|in\b|not in\b)|mode\s*(==|!=)\s*["'](full|memory|sparse|lora)["']""")


def test_no_code_outside_the_component_branches_on_a_mode_name():
    """configs, docs and tests name the modes; the code asks memlm.finetune.modes."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("finetune", "tests", ".venv", "build", "docs", "runs") or rel.parts[0].startswith("."):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if BRANCH.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
