"""data.rows=documents (memlm.data.loader.DocumentRows): one document per row, padded, its padding's
targets IGNORE; a source's k-th row is its k-th document; the state resumes exactly and refuses the
other row mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.config.run import compose
from memlm.data.config import IGNORE
from memlm.data.corpus import Corpus
from memlm.data.loader import DocumentRows, PackedBatches, TokenLoader
from memlm.data.stream import TokenSource
from memlm.errors import ConfigError

LENGTHS = [3, 5, 2, 7, 4, 6]  # tokens of each document, its EOS included


def _documents() -> list[np.ndarray]:
    """Document d holds 100 * d + 1, ..., its length: every token names its document and place."""
    return [np.arange(1, n + 1, dtype=np.uint32) + 100 * d for d, n in enumerate(LENGTHS)]


def _loader(node=DocumentRows, micro_batch=2, seq_len=7, shuffle=False, rank=0, world=1) -> TokenLoader:
    docs = _documents()
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    corpus = Corpus([TokenSource("facts", [(np.concatenate(docs), offsets)], 0, shuffle)], [1.0], vocab_size=1000)
    return TokenLoader(node(corpus, seq_len, micro_batch, rank, world, 0, "train", "test"), corpus, prefetch=0)


def test_each_row_is_one_document_from_its_start_in_file_order():
    loader = _loader()
    rows = []
    for _ in range(4):  # 8 rows: the 6 documents, then the second epoch's first two
        inputs, targets = next(loader)
        for x, y in zip(inputs, targets):
            rows.append((x.tolist(), y.tolist()))
    docs = _documents() + _documents()[:2]
    for (x, y), doc in zip(rows, docs):
        n = len(doc)
        assert x[:n] == doc.tolist() and x[n:] == [0] * (7 - n)  # inputs: the document (its EOS too), then 0
        assert y[:n - 1] == doc[1:].tolist() and y[n - 1:] == [IGNORE] * (8 - n)  # no target after its end


def test_the_state_counts_documents_and_resumes_exactly():
    loader = _loader()
    next(loader)
    state = loader.state_dict()
    assert state["rows"] == "documents" and state["positions"] == {"facts": 2}
    rest = [next(loader) for _ in range(3)]
    again = _loader()
    again.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(rest, [next(again) for _ in range(3)]):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_two_ranks_read_the_one_process_rows():
    one = next(_loader(micro_batch=4))[0]
    ranks = torch.cat([next(_loader(micro_batch=2, rank=r, world=2))[0] for r in range(2)])
    assert torch.equal(one, ranks)


def test_a_packed_state_is_refused_by_document_rows_and_back():
    packed = _loader(node=PackedBatches)
    next(packed)
    with pytest.raises(ConfigError) as err:
        _loader().load_state_dict(packed.state_dict())
    assert err.value.key == "data.rows"
    rows = _loader()
    next(rows)
    with pytest.raises(ConfigError) as err:
        _loader(node=PackedBatches).load_state_dict(rows.state_dict())
    assert err.value.key == "data.rows"


def test_a_document_longer_than_a_row_is_refused_naming_the_length_needed():
    with pytest.raises(ConfigError) as err:
        _loader(seq_len=5)  # the longest document has 7 tokens with its EOS
    assert err.value.key == "data.seq_len" and "at least 6" in str(err.value)


def test_bad_settings_name_the_key_and_the_choices():
    with pytest.raises(ConfigError) as err:
        compose(["data.rows=lines"])
    assert err.value.key == "data.rows" and "packed, documents" in str(err.value)
    with pytest.raises(ConfigError) as err:
        compose(["data.kind=random", "data.rows=documents"])
    assert err.value.key == "data.rows" and "random" in str(err.value)


def test_a_training_step_on_document_rows_learns_from_the_documents_alone(tmp_path):
    """The trainer's loss on padded rows is the mean cross-entropy over the documents' tokens."""
    import copy
    import json

    import torch.nn.functional as F
    from evals_fixtures import VOCAB, make_tokenizer

    from memlm.data.loader import build_loader
    from memlm.train.trainer import Trainer

    make_tokenizer(tmp_path)
    tok = tmp_path / "tok.model"
    path = tmp_path / "facts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Q: a?\nA: b", "The sky is blue.", "x y"]))
    cfg = compose(["data.kind=raw", f"data.sources=[{{name: f, path: {path}}}]", f"data.tokenizer={tok}",
                   "data.rows=documents", "data.shuffle=false", "data.micro_batch=3", "data.seq_len=16",
                   "data.prefetch=0", f"model.vocab_size={VOCAB}", "optim.warmup=0", f"dump_dir={tmp_path / 'run'}"])
    inputs, targets = next(build_loader(cfg.data))
    assert (targets == IGNORE).any() and (targets != IGNORE).any()
    trainer = Trainer(cfg)
    model = copy.deepcopy(trainer.model)
    with torch.no_grad():
        logits = model(inputs)
    expected = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
    loss = trainer.train_step()["loss"]
    assert abs(loss - expected.item()) <= 1e-6 * abs(expected.item())
