"""build_loader from config: every kind, presets, validation, raw == prepared, and 2 gloo ranks."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

from memlm.data.config import DataConfig, SourceConfig
from memlm.data.loader import build_loader
from memlm.data.prepare import prepare
from memlm.data.stats import DataError
from memlm.data.tokenizer import train_tokenizer
from memlm.errors import ConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    docs = {"news": [f"news item {i} about the weather" for i in range(80)],
            "code": [f"def f{i}(x): return x * {i}" for i in range(40)]}
    for name, texts in docs.items():
        with open(root / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tok = train_tokenizer(docs["news"] + docs["code"], str(root / "tok.model"), vocab_size=300)
    sources = [SourceConfig(name="news", path=str(root / "news.jsonl"), weight=2.0),
               SourceConfig(name="code", path=str(root / "code.jsonl"), weight=1.0)]
    return root, docs, tok, sources


def _raw_cfg(corpus, **kw) -> DataConfig:
    root, _, tok, sources = corpus
    return DataConfig(kind="raw", sources=copy.deepcopy(sources), tokenizer=tok.path, seq_len=12, micro_batch=3, **kw)


def _batches(loader, n):
    return [next(loader) for _ in range(n)]


def test_raw_mode_packs_eos_separated_documents(corpus):
    _, docs, tok, _ = corpus
    loader = build_loader(_raw_cfg(corpus, shuffle=False))
    assert loader.vocab_size == tok.vocab_size and loader.tokenizer.sha256 == tok.sha256
    x, _ = next(loader)
    text = tok.decode([t for t in x.ravel().tolist() if t != tok.eos_id])
    assert "news item 0 about" in text or "def f0(x)" in text
    assert (x == tok.eos_id).any()  # documents are separated by EOS
    assert "news" in loader.describe() and "nothing skipped" in loader.describe()


def test_prepared_shards_yield_the_same_batches_as_raw_mode(corpus, tmp_path):
    root, _, tok, sources = corpus
    prepare(sources, tok.path, str(tmp_path), val_fraction=0.0, show_progress=False)
    shards = DataConfig(kind="shards", shards_dir=str(tmp_path), sources=sources, seq_len=12, micro_batch=3)
    a, b = build_loader(_raw_cfg(corpus)), build_loader(shards)
    for (x1, y1), (x2, y2) in zip(_batches(a, 30), _batches(b, 30)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_tokenizing_in_worker_processes_gives_the_same_batches(corpus):
    one, two = build_loader(_raw_cfg(corpus)), build_loader(_raw_cfg(corpus, num_workers=2))
    for (x1, _), (x2, _) in zip(_batches(one, 10), _batches(two, 10)):
        assert torch.equal(x1, x2)


def test_validation_split_is_disjoint_from_train(corpus):
    train = build_loader(_raw_cfg(corpus, val_fraction=0.3, shuffle=False), split="train")
    val = build_loader(_raw_cfg(corpus, val_fraction=0.3, shuffle=False), split="val")
    sizes = [{s.name: s.tokens_per_epoch for s in ld.node.sources} for ld in (train, val)]
    full = {s.name: s.tokens_per_epoch for s in build_loader(_raw_cfg(corpus)).node.sources}
    assert all(sizes[0][n] + sizes[1][n] == full[n] and sizes[1][n] > 0 for n in full)
    with pytest.raises(ConfigError, match="val_fraction"):
        build_loader(_raw_cfg(corpus), split="val")


def test_bad_records_in_raw_mode(corpus, tmp_path):
    _, _, tok, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine document"}\n{"txt": "wrong key"}\n')
    cfg = DataConfig(kind="raw", sources=[SourceConfig(path=str(bad))], tokenizer=tok.path)
    with pytest.raises(DataError, match=f"{bad}:2: missing field"):
        build_loader(cfg)
    cfg.on_error = "skip"
    loader = build_loader(cfg)
    assert loader.stats["source0"].skipped == {"missing_field": 1}
    assert "missing_field=1" in loader.describe()


def test_random_kind_and_resume():
    cfg = DataConfig(vocab_size=97, seq_len=8, micro_batch=2)
    loader = build_loader(cfg, rank=1, world_size=2)
    x, y = next(loader)
    assert x.shape == (2, 8) and int(x.max()) < 97 and loader.tokenizer is None
    state = loader.state_dict()
    expected = _batches(loader, 3)
    again = build_loader(cfg, rank=1, world_size=2)
    again.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_batches(again, 3), expected))
    val = build_loader(cfg, rank=1, world_size=2, split="val")
    assert not torch.equal(next(val)[0], x)  # validation batches are not training batches


def test_synthetic_kind_materializes_once(tmp_path):
    cfg = DataConfig(kind="synthetic", cache_dir=str(tmp_path), vocab_size=400, seq_len=32, micro_batch=2)
    cfg.synthetic.people = 30
    loader = build_loader(cfg)
    (folder,) = tmp_path.glob("synthetic-p30-d4-s0-g*")  # + the generator's digest
    assert sorted(os.listdir(folder)) == [".lock", "people.jsonl", "qa.jsonl", "tokenizer-v400.model", "train.jsonl"]
    assert loader.vocab_size <= 400
    stamp = os.stat(folder / "tokenizer-v400.model").st_mtime_ns
    again = build_loader(cfg)
    assert os.stat(folder / "tokenizer-v400.model").st_mtime_ns == stamp  # reused, not retrained
    assert torch.equal(next(loader)[0], next(again)[0])


@pytest.mark.parametrize(("field", "value", "match"), [
    ("seq_len", 0, "positive integer"),
    ("kind", "web", "one of: random, synthetic, facts, raw, shards"),
    ("on_error", "ignore", "one of: raise, skip"),
    ("prefetch", -1, "0 disables prefetch"),
    ("val_fraction", 1.0, r"\[0, 1\)"),
])
def test_config_validation(field, value, match):
    cfg = DataConfig()
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_source_validation(corpus):
    cfg = _raw_cfg(corpus)
    cfg.sources = []
    with pytest.raises(ConfigError, match="data.sources"):  # an empty source list
        cfg.validate()
    cfg = _raw_cfg(corpus)
    cfg.sources[1].weight = 0
    with pytest.raises(ConfigError, match=r"sources\[1\].weight"):
        cfg.validate()
    cfg.sources[1].weight, cfg.sources[1].name = 1, "news"
    with pytest.raises(ConfigError, match="not used by another source"):
        cfg.validate()
    cfg = _raw_cfg(corpus)
    cfg.sources[0].path = "/nonexistent/*.jsonl"
    with pytest.raises(ConfigError, match="matches at least one file"):
        build_loader(cfg)
    with pytest.raises(ConfigError, match="rank"):
        build_loader(DataConfig(), rank=2, world_size=2)


def test_presets_compose():
    from memlm.config.run import compose

    assert compose().data.kind == "random"
    syn = compose(["data=synthetic"]).data
    assert syn.kind == "synthetic" and syn.synthetic.people > 0 and syn.val_fraction == 0.0
    with pytest.raises(ConfigError, match="data.on_error"):
        compose(["data.on_error=maybe"])


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    loader = build_loader(DataConfig(vocab_size=1000, seq_len=6, micro_batch=2),
                          dist.get_rank(), dist.get_world_size())
    mine = torch.stack([next(loader)[0] for _ in range(4)])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        torch.save(torch.stack(gathered), os.path.join(out_dir, "batches.pt"))
    dist.destroy_process_group()


def test_two_gloo_processes_match_simulated_ranks(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_worker, args=(2, port, str(tmp_path)), nprocs=2)
    real = torch.load(tmp_path / "batches.pt", weights_only=True)  # (rank, step, batch, seq)
    for rank in range(2):
        sim = build_loader(DataConfig(vocab_size=1000, seq_len=6, micro_batch=2), rank, 2)
        assert torch.equal(real[rank], torch.stack([next(sim)[0] for _ in range(4)]))
    assert not np.array_equal(real[0].numpy(), real[1].numpy())
