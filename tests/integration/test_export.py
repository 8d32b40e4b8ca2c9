"""Export to safetensors / Hugging Face layout and back."""

from __future__ import annotations

import json

import pytest
import torch

from memlm.config.run import compose
from memlm.hf import from_pretrained
from memlm.run.export import export, main
from memlm.train.trainer import Trainer

BASE = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "logging.wandb.mode=disabled",
        "steps=3", "optim.lr=3e-3"]


def _train(tmp_path, extra=()):
    trainer = Trainer(compose([*BASE, *extra, f"dump_dir={tmp_path / 'run'}"]))
    trainer.fit()
    return trainer.model.eval()


def test_dense_export_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = _train(tmp_path)
    out = export(tmp_path / "run", tmp_path / "export")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).float().eval()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
        assert torch.equal(from_pretrained(out)(tokens), ours(tokens))


def test_sharded_export_round_trips(tmp_path, capsys):
    ours = _train(tmp_path)
    assert main([str(tmp_path / "run" / "checkpoints" / "latest"), str(tmp_path / "x"),
                 "--max-shard-size", "100KB"]) == 0
    index = json.loads((tmp_path / "x" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path / "x")(tokens), ours(tokens))
    assert "[export]" in capsys.readouterr().out


def test_memplus_export_round_trips(tmp_path):
    ours = _train(tmp_path, ["model.n_layers=3", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8",
                             "memory.knn=4", "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16"])
    out = export(tmp_path / "run", tmp_path / "export")
    config = json.loads((out / "memlm_config.json").read_text())
    assert config["weights_layout"] == "memlm" and config["memory"]["kind"] == "memplus"
    hf_config = json.loads((out / "config.json").read_text())  # the trust_remote_code bundle (test_hf_remote.py)
    assert hf_config["model_type"] == "memlm" and (out / "modeling_memlm.py").is_file()
    loaded = from_pretrained(out)
    assert "shared.memory_values.weight" in loaded.state_dict()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), ours(tokens))
