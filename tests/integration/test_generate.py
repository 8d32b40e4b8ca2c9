"""Generation (memlm.generation.text, `python -m memlm.generate`): greedy
equals the evals' decoding, sampling against a hand-written reference, seeds,
the KV cache against a recompute, and the command line on a checkpoint and
on an export."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from evals_fixtures import make_model, make_tokenizer, train_tiny_run

from memlm.errors import ConfigError
from memlm.generate import generate, load
from memlm.generate.cli import main
from memlm.generation.decoding import decode, generate_texts, greedy_generate, prompt_ids
from memlm.generation.sampling import Sampling

NO_EOS = -1
CONTEXTS = ["Q: Where was Ada born?\nA:", "Q: Who?\nA:", "The", "Q: Where was Ada born?\nA: In"]


@pytest.fixture(scope="module")
def model():
    return make_model(max_seq_len=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def greedy_tokens(model, tokenizer, contexts, n):
    return greedy_generate(model, [prompt_ids(tokenizer, c) for c in contexts], n, tokenizer.eos_id)[0]


def test_greedy_generation_is_the_evals_decoding(model, tokenizer):
    done = generate(model, tokenizer, CONTEXTS, max_new_tokens=12, batch_size=3)
    assert [c.tokens for c in done] == greedy_tokens(model, tokenizer, CONTEXTS, 12)
    texts, truncated = generate_texts(model, tokenizer, CONTEXTS, ["\n"], 12)
    stopped = generate(model, tokenizer, CONTEXTS, max_new_tokens=12, stop=["\n"])
    assert [c.text for c in stopped] == texts and [c.truncated for c in stopped] == truncated
    for c in stopped:
        assert c.finish_reason in ("eos", "stop", "length") and "\n" not in c.text
        assert (c.finish_reason == "stop") == ("\n" in tokenizer.decode(c.tokens))


def test_near_zero_temperature_top_k_1_and_tiny_top_p_are_greedy(model, tokenizer):
    greedy = greedy_tokens(model, tokenizer, CONTEXTS, 10)
    for kwargs in ({"temperature": 1e-5}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6}):
        done = generate(model, tokenizer, CONTEXTS, max_new_tokens=10, seed=3, **kwargs)
        assert [c.tokens for c in done] == greedy, kwargs


def test_seeded_sampling_is_reproducible_and_independent_of_batching(model, tokenizer):
    def run(seed, batch_size=16):
        return [c.tokens for c in generate(model, tokenizer, CONTEXTS, max_new_tokens=10, temperature=1.0,
                                           top_p=0.95, seed=seed, batch_size=batch_size)]

    first = run(7)
    assert run(7) == first and run(7, batch_size=1) == first
    assert run(8) != first  # another seed, other draws
    assert first != greedy_tokens(model, tokenizer, CONTEXTS, 10)  # it really samples


def reference_probabilities(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The definition, one token at a time in plain Python."""
    weights = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = set(order[:top_k] if top_k else order)
    total, mass, nucleus = sum(weights), 0.0, set()
    for i in order:
        if mass >= top_p:
            break
        nucleus.add(i)
        mass += weights[i] / total
    kept = keep & nucleus
    norm = sum(weights[i] for i in kept)
    return [weights[i] / norm if i in kept else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (2.0, 0, 1.0), (0.5, 3, 1.0),
                                                       (1.0, 0, 0.7), (0.7, 4, 0.9), (1.0, 0, 0.05)])
def test_sampling_distribution_matches_the_definition(temperature, top_k, top_p):
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3, 0.0001, 0.0399]]))
    got = Sampling(temperature, top_k, top_p).probabilities(logits)[0]
    expected = reference_probabilities(logits[0].tolist(), temperature, top_k, top_p)
    assert got.tolist() == pytest.approx(expected, abs=1e-6)


def test_sampled_tokens_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    pick = Sampling(temperature=1.0, seed=0).picker(4000)
    counts = torch.bincount(torch.cat([pick(logits, [i]) for i in range(4000)]), minlength=3) / 4000
    assert counts.tolist() == pytest.approx([0.1, 0.6, 0.3], abs=0.03)  # ~4 standard errors


def test_kv_cache_step_logits_equal_a_full_recompute(model):
    prompts = [torch.randint(4, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 5)]
    pick = Sampling(temperature=1.0, seed=1).picker(len(prompts))
    steps: dict[bool, list] = {True: [], False: []}

    def recorder(use_cache):
        def record(logits, rows):
            tokens = pick(logits, rows)
            steps[use_cache].append((list(rows), logits.clone(), tokens.clone()))
            return tokens
        return record

    cached = decode(model, prompts, 12, NO_EOS, use_cache=True, pick=recorder(True))
    pick = Sampling(temperature=1.0, seed=1).picker(len(prompts))  # a fresh stream for the reference
    uncached = decode(model, prompts, 12, NO_EOS, use_cache=False, pick=recorder(False))
    assert cached.tokens == uncached.tokens and len(steps[True]) == len(steps[False]) == 2 * 12
    for (rows, a, ta), (rows_ref, b, tb) in zip(steps[True], steps[False]):
        assert rows == rows_ref and torch.equal(ta, tb)
        assert (a - b).abs().max().item() <= 1e-5


def test_python_call_rejects_bad_values(model, tokenizer):
    for kwargs, key in [({"temperature": -1.0}, "temperature=-1.0"), ({"temperature": math.inf}, "temperature=inf"),
                        ({"top_p": 0.0}, "top_p=0.0"), ({"top_p": 1.5}, "top_p=1.5"), ({"top_k": -2}, "top_k=-2"),
                        ({"max_new_tokens": 64}, "max_new_tokens=64"), ({"max_new_tokens": 0}, "max_new_tokens=0"),
                        ({"stop": "\n"}, "stop="), ({"stop": [""]}, "stop="), ({"batch_size": 0}, "batch_size=0")]:
        with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
            generate(model, tokenizer, "Q:", **{"max_new_tokens": 8, **kwargs})


# ------------------------------------------------------------------ command line
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("genrun")
    return train_tiny_run(root / "run", root / "cache")


@pytest.fixture(scope="module")
def export_dir(run_dir, tmp_path_factory):
    from memlm.run.export import export

    return export(run_dir / "checkpoints" / "latest", tmp_path_factory.mktemp("genexport") / "export")


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_cli_on_a_checkpoint_prints_what_the_python_call_returns(run_dir, capsys):
    args = [str(run_dir), "--prompt", r"Q: Where was Ada born?\nA:", "--prompt", "The", "--max-new-tokens", "8",
            "--stop", r"\n", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    model, tokenizer = load(run_dir)
    expected = generate(model, tokenizer, ["Q: Where was Ada born?\nA:", "The"], max_new_tokens=8, stop=["\n"])
    assert json_lines(out) == [{"index": i, **c.to_dict()} for i, c in enumerate(expected)]
    assert "[generate] done: 2 completion(s), greedy" in err
    assert main([str(run_dir), "--prompt", "The", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == expected[1].text + "\n"


def test_cli_on_an_export_with_prompt_files_and_sampling(run_dir, export_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("The\n\nQ: Who?\\nA:\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Q: Where?\nA:"}) + "\n" + json.dumps("Ada") + "\n")
    args = ["--prompt-file", str(tmp_path / "p.txt"), "--prompt-file", str(tmp_path / "p.jsonl"),
            "--max-new-tokens", "6", "--json"]
    assert main([str(export_dir), *args]) == 0
    out, err = capsys.readouterr()
    from_export = json_lines(out)
    assert [r["prompt"] for r in from_export] == ["The", "Q: Who?\nA:", "Q: Where?\nA:", "Ada"]
    assert "1 blank prompt-file line(s) skipped" in err
    assert main([str(run_dir), *args]) == 0  # the export holds the same weights and tokenizer
    assert json_lines(capsys.readouterr().out) == from_export
    sampled = [str(export_dir), *args, "--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--seed", "4"]
    assert main(sampled) == 0
    first = capsys.readouterr()
    assert main(sampled) == 0
    assert capsys.readouterr().out == first.out and "sampled (temperature 0.9" in first.err


def test_python_m_memlm_generate(run_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memlm.generate", str(run_dir), "--prompt", "The",
                           "--max-new-tokens", "4", "--json"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    (row,) = json_lines(proc.stdout)
    assert row["prompt"] == "The" and len(row["tokens"]) <= 4 and "[generate] done" in proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "memlm.generate", "--help"], capture_output=True, text=True,
                               timeout=300).stdout
    assert "--temperature" in help_text and "--top-p" in help_text and "--prompt-file" in help_text


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-1"], "temperature=-1.0: a finite number >= 0"),
    (["--top-p", "1.5"], "top_p=1.5: a number in (0, 1]"),
    (["--top-k", "-1"], "top_k=-1: an integer >= 0"),
    (["--max-new-tokens", "0"], "max_new_tokens=0"),
    (["--max-new-tokens", "256"], "max_new_tokens=256: an integer in [1, 255]"),
    (["--batch-size", "0"], "batch_size=0"),
    (["--device", "tpu"], "device='tpu'"),
])
def test_cli_bad_values_exit_2_naming_the_value(run_dir, capsys, extra, message):
    assert main([str(run_dir), "--prompt", "The", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_bad_paths_and_missing_prompts_exit_2_or_1_for_a_folder_without_a_model(run_dir, tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--prompt", "x"]) == 1  # a missing model path: 1, as from every command
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert main([str(tmp_path), "--prompt", "x"]) == 1  # a folder that holds no model: a CheckpointError
    assert str(tmp_path) in capsys.readouterr().err
    assert main([str(run_dir)]) == 2
    assert "--prompt" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": 1}\n')
    assert main([str(run_dir), "--prompt-file", str(tmp_path / "bad.jsonl")]) == 2
    assert f"{tmp_path / 'bad.jsonl'}:2" in capsys.readouterr().err
    assert main([str(run_dir), "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(run_dir), "--temperature", "hot"])  # argparse: not a number
    assert exit_info.value.code == 2
