"""An export as plain transformers code sees it: tokenizer ids, logits and greedy answers equal memlm's.

transformers 5 (the dev venv) runs here in-process. The newest 4.x runs through
tests/helpers/hf_bundle_checker.py under the interpreter named by MEMLM_TF4_PYTHON
(docs/checkpoints.md, "Checking an export under transformers 4.x"):

    python3 -m venv /tmp/venv-tf4
    /tmp/venv-tf4/bin/pip install "transformers==4.57.*" torch safetensors
    MEMLM_TF4_PYTHON=/tmp/venv-tf4/bin/python python -m pytest tests/integration/test_hf_bundle.py
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="install the dev extra: pip install -e '.[dev]'")

from hf_bundle_checker import check  # noqa: E402

from memlm.config.eval import EvalConfig  # noqa: E402
from memlm.config.run import compose  # noqa: E402
from memlm.data.tokenizer import Tokenizer  # noqa: E402
from memlm.errors import ConfigError  # noqa: E402
from memlm.evals.prompts import qa_prompt  # noqa: E402
from memlm.evals.tasks import load_task  # noqa: E402
from memlm.generation.decoding import generate_texts, greedy_generate, prompt_ids  # noqa: E402
from memlm.hf.bundle import tokenizer_json  # noqa: E402
from memlm.run.export import export  # noqa: E402
from memlm.run.load import load_model  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402

CHECKER = Path(__file__).resolve().parents[1] / "helpers" / "hf_bundle_checker.py"
# ASCII, Unicode (byte fallback included), leading / trailing / repeated spaces, empty, control-token text.
TEXTS = ["", " ", "   ", "Hello world", "  two leading spaces", "trailing  ", "a  b   c", "tab\tand\nnewline",
         "Q: Where was Anna born?\nA:", "12345 67", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀", "Ωμέγα ß ø",
         "</s> and <s> as text", "<unk><pad>", "\n\n", "end.\n"]
ROPE_THETA = 500000.0
MAX_NEW_TOKENS = 12
N_QUESTIONS = 50
SYNTHETIC = ["data=synthetic", "data.synthetic.people=40", "data.seq_len=64", "data.micro_batch=4",
             "model.vocab_size=512", "model.max_seq_len=256", f"model.rope_theta={ROPE_THETA}",
             "logging.wandb.mode=disabled", "optim.lr=3e-3"]
MEMPLUS = ["model.n_layers=3", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4",
           "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16"]


def _export(tmp_path_factory, name: str, extra: list[str], steps: int) -> Path:
    root = tmp_path_factory.mktemp(name)
    cache = tmp_path_factory.getbasetemp() / "synthetic-cache"  # one corpus + tokenizer for both runs
    Trainer(compose([*SYNTHETIC, *extra, f"steps={steps}", f"data.cache_dir={cache}",
                     f"dump_dir={root / 'run'}"])).fit()
    return export(root / "run", root / "export")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    # Enough steps for the dense model to answer in varied tokens, not one repeated piece.
    return {"dense": _export(tmp_path_factory, "dense", [], 120),
            "memplus": _export(tmp_path_factory, "memplus", MEMPLUS, 2)}


@pytest.fixture(scope="module")
def questions(exports, tmp_path_factory) -> tuple[list[str], list[list[int]], list[str]]:
    """50 synthetic-QA prompts (2 shots) and memlm's greedy answers: tokens (no stop) and texts (cut at stop)."""
    loaded = load_model(exports["dense"])
    tok = Tokenizer(loaded.tokenizer_path)
    cfg = EvalConfig(num_fewshot=2, limit=N_QUESTIONS)
    data_cfg = compose([*SYNTHETIC, f"data.cache_dir={tmp_path_factory.getbasetemp() / 'synthetic-cache'}"]).data
    task = load_task("synthetic_qa", cfg, data_cfg)
    contexts = [qa_prompt(task.shots[""], ex["question"]) for ex in task.examples]
    assert len(contexts) == N_QUESTIONS
    tokens, cut = greedy_generate(loaded.model, [prompt_ids(tok, c) for c in contexts], MAX_NEW_TOKENS,
                                  tok.eos_id, batch_size=8)
    texts, _ = generate_texts(loaded.model, tok, contexts, cfg.stop, MAX_NEW_TOKENS, batch_size=8)
    assert not any(cut)
    assert len({tuple(t) for t in tokens}) > 5, "the tiny model should answer in varied tokens"
    return contexts, tokens, texts


def _memlm_tokens(export_dir: Path) -> Tokenizer:
    return Tokenizer(str(export_dir / "tokenizer.model"))


def _assert_ids_equal_memlm(result: dict, tok: Tokenizer) -> None:
    for text, plain, full, decoded in zip(TEXTS, result["plain"], result["with_special"], result["decoded"]):
        assert plain == tok.encode(text), text
        assert full == prompt_ids(tok, text), text  # eos first, as memlm prompts
        assert decoded == text == tok.decode(plain)
    assert result["special"] == {"bos": tok.eos_id, "eos": tok.eos_id, "pad": tok.pad_id}


def _rows(vocab: int) -> list[list[int]]:
    return torch.randint(4, vocab, (2, 200), generator=torch.Generator().manual_seed(0)).tolist()


def _memlm_logits(export_dir: Path, rows: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return load_model(export_dir).model(torch.tensor(rows))  # (batch, seq, vocab)


def _assert_answers_equal(result: dict, questions) -> None:
    _, tokens, texts = questions
    mismatched = [i for i, (a, b) in enumerate(zip(result["generated"], tokens)) if a != b]
    assert not mismatched, f"{len(mismatched)}/{len(tokens)} answers differ, first at question {mismatched[:1]}"
    assert [a.split("\n")[0] for a in result["answers"]] == texts
    assert result["generation_config"] == {"do_sample": False, "eos": 2, "pad": 3}


@pytest.mark.parametrize("kind", ["dense", "memplus"])
def test_auto_tokenizer_gives_memlm_ids(exports, kind):
    result = check(str(exports[kind]), {"texts": TEXTS})
    _assert_ids_equal_memlm(result, _memlm_tokens(exports[kind]))
    files = {p.name for p in exports[kind].iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "tokenizer.model"} <= files


def test_tokenizer_json_equals_sentencepiece_on_random_text(exports, tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer

    tok = _memlm_tokens(exports["dense"])
    hf = HFTokenizer.from_str(json.dumps(tokenizer_json(tok.path)))
    hf.encode_special_tokens = True  # what tokenizer_config's split_special_tokens sets
    rng = random.Random(0)
    alphabet = "abcdefghijklmnop ABCDE  \n\t.,?'0123456789éßø日本🙂-"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(1500)]
    corpus = next((tmp_path_factory.getbasetemp() / "synthetic-cache").glob("*/train.jsonl"))
    texts += [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:100]]
    wrong = [t for t in texts if hf.encode(t, add_special_tokens=False).ids != tok.encode(t)]
    assert not wrong, f"{len(wrong)}/{len(texts)} texts encode differently, e.g. {wrong[:3]}"


def test_generate_reproduces_memlm_greedy_answers(exports, questions):
    result = check(str(exports["dense"]), {"texts": [], "prompts": questions[0], "max_new_tokens": MAX_NEW_TOKENS})
    _assert_answers_equal(result, questions)


def test_memplus_generate_reproduces_memlm_greedy_answers(exports):
    out = exports["memplus"]
    if not (out / "config.json").is_file():
        pytest.skip("a Memory+ export has no transformers config.json / modeling file yet "
                    "(issue 23, trust_remote_code)")
    loaded = load_model(out)
    tok = _memlm_tokens(out)
    prompts = ["Q: Where was Anna born?\nA:", "The capital", ""]
    tokens, _ = greedy_generate(loaded.model, [prompt_ids(tok, p) for p in prompts], MAX_NEW_TOKENS, tok.eos_id)
    result = check(str(out), {"texts": [], "prompts": prompts, "max_new_tokens": MAX_NEW_TOKENS})
    assert result["generated"] == tokens


def test_dense_config_is_portable_and_logits_match(exports):
    out = exports["dense"]
    config = json.loads((out / "config.json").read_text())
    # transformers 4.x reads rope_theta only at the top level (else silently 10000).
    assert config.get("rope_theta") == ROPE_THETA
    assert (config["bos_token_id"], config["eos_token_id"], config.get("pad_token_id")) == (2, 2, 3)
    rows = _rows(512)
    result = check(str(out), {"texts": [], "tokens": rows})
    assert (torch.tensor(result["logits"]) - _memlm_logits(out, rows)).abs().max().item() <= 1e-4


def test_unsupported_sentencepiece_model_is_refused(tmp_path):
    import sentencepiece as spm

    lines = [f"line {i} of some text with words like alpha beta gamma" for i in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "uni"),
                                   model_type="unigram", vocab_size=40, hard_vocab_limit=False, minloglevel=2)
    with pytest.raises(ConfigError, match="model_type.*BPE sentencepiece model"):
        tokenizer_json(tmp_path / "uni.model")


@pytest.mark.slow
def test_transformers4_gives_the_same_ids_logits_and_answers(exports, questions, tmp_path):
    python = os.environ.get("MEMLM_TF4_PYTHON")
    if not python:
        pytest.skip("MEMLM_TF4_PYTHON unset: the interpreter of a venv with transformers 4.x "
                    "(docs/checkpoints.md, 'Checking an export under transformers 4.x')")
    rows = _rows(512)
    cases = {"texts": TEXTS, "tokens": rows, "prompts": questions[0], "max_new_tokens": MAX_NEW_TOKENS}
    for kind in ("dense", "memplus"):  # Memory+: the tokenizer (its modeling file is tested with it)
        (tmp_path / "cases.json").write_text(json.dumps(cases if kind == "dense" else {"texts": TEXTS}))
        run = subprocess.run([python, str(CHECKER), str(exports[kind]), str(tmp_path / "cases.json"),
                              str(tmp_path / "out.json")], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": ""})  # plain transformers: no memlm on the path
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads((tmp_path / "out.json").read_text())
        assert result["transformers"].startswith("4."), result["transformers"]
        _assert_ids_equal_memlm(result, _memlm_tokens(exports[kind]))
        if kind == "dense":
            assert (torch.tensor(result["logits"]) - _memlm_logits(exports[kind], rows)).abs().max().item() <= 1e-4
            _assert_answers_equal(result, questions)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
