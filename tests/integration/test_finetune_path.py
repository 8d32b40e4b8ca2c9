"""The documented sparse fine-tuning path from a model no memlm run trained (docs/finetuning.md):
a transformers-made Llama, retrofitted with a Memory+ layer, its background written by
`python -m memlm.train.slot_usage` over a named corpus, `finetune=sparse` from it, the export
loaded by transformers with memlm's logits. And `init_from` naming a run the ways every
other command accepts (its dump_dir, its checkpoints/latest)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")

from memlm.config.run import compose  # noqa: E402
from memlm.finetune.background import load_usage  # noqa: E402
from memlm.run.load import load_model  # noqa: E402
from memlm.train import slot_usage  # noqa: E402
from memlm.train.preflight import check_init_from  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402

ARCH = ["model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden_dim=96", "model.rope_theta=10000.0", "model.norm_eps=1e-6", "model.tie_embeddings=false"]
RETROFIT = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4",
            "memory.k_dim=16", "memory.heads=2", "memory.placement=parallel"]
RUN = ["data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "logging.wandb.mode=disabled", "val_batches=0"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(7)
    directory = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).float().save_pretrained(directory)
    return directory


def test_a_llama_retrofitted_then_sparse_finetuned_then_exported(llama, tmp_path):
    from hf_remote_child import run_remote_child

    from memlm.run.export import export

    corpus = ["data=synthetic", "data.synthetic.people=20", f"data.cache_dir={tmp_path / 'corpus'}"]
    background = tmp_path / "background.safetensors"
    # 1. the background of the retrofitted model (fresh memory, the run's seed) over a corpus named here
    assert slot_usage.main([f"hf:{llama}", "--batches", "3", "--out", str(background),
                            *ARCH, *RETROFIT, *RUN, *corpus]) == 0
    counts = load_usage(background, {"layer1": 64})
    assert int(counts["layer1"].sum()) == 3 * 2 * 16 * 2 * 4  # batches x micro_batch x seq_len x heads x knn
    # 2. finetune=sparse from the same Llama, with that background
    run = tmp_path / "run"
    cfg = compose([*ARCH, *RETROFIT, *RUN, *corpus, f"init_from=hf:{llama}", "finetune=sparse",
                   "finetune.top_t=6", f"finetune.background={background}", "memory.value_lr=1e-2", "steps=3",
                   "checkpoint.at_end=true", f"dump_dir={run}"])
    check_init_from(cfg)
    trainer = Trainer(cfg)
    # the model slot_usage counted is the one the fine-tune starts from, tensor for tensor
    tokenizer = getattr(trainer.train_loader, "tokenizer", None)
    started = slot_usage.start_model(cfg, trainer.init_source, tokenizer).state_dict()
    assert all(torch.equal(v, started[k]) for k, v in trainer.model.state_dict().items())
    first = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.fit()
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, first[k])]
    assert changed == ["shared.memory_values.weight"]  # only the value table moved
    rows = (trainer.model.state_dict()["shared.memory_values.weight"] != first["shared.memory_values.weight"]).any(1)
    assert 1 <= int(rows.sum()) <= 3 * 6  # at most top_t rows a step
    # 3. the export, read by transformers (trust_remote_code), gives memlm's logits
    model = load_model(run).model
    run_remote_child(sys.executable, True, export(run, tmp_path / "export"), model, tmp_path)


TINY = ["model.vocab_size=128", *RUN, "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4",
        "memory.eval_knn=4", "memory.k_dim=16", "memory.heads=2"]


@pytest.mark.parametrize("name", ["dump_dir", "latest"])
def test_init_from_a_run_folder_or_its_latest_starts_from_its_newest_checkpoint(tmp_path, name):
    base = tmp_path / "base"
    Trainer(compose([*TINY, "steps=4", "checkpoint.every=2", f"dump_dir={base}"])).fit()
    newest = load_model(base / "checkpoints" / "step_00000004")
    assert newest.step == 4 and (base / "checkpoints" / "step_00000002").is_dir()  # an older one exists
    init_from = base if name == "dump_dir" else base / "checkpoints" / "latest"
    cfg = compose([*TINY, "finetune=memory", f"init_from={init_from}", "steps=1", f"dump_dir={tmp_path / 'ft'}"])
    check_init_from(cfg)
    trainer = Trainer(cfg)
    try:
        ours, theirs = trainer.model.state_dict(), newest.model.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    finally:
        trainer.close()


def test_a_run_reads_its_init_from_checkpoints_meta_once(tmp_path, monkeypatch):
    """The preflight reads and checks init_from's meta.json; the load verifies the files against that read."""
    base = tmp_path / "base"
    Trainer(compose([*TINY, "steps=2", f"dump_dir={base}"])).fit()
    meta = base / "checkpoints" / "step_00000002" / "meta.json"
    reads = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **kw: (reads.append(self), read_text(self, *a, **kw))[1])
    cfg = compose([*TINY, "finetune=memory", f"init_from={base}", "steps=1", f"dump_dir={tmp_path / 'ft'}"])
    Trainer(cfg).close()
    assert reads.count(meta) == 1
