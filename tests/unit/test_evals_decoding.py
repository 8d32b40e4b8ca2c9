"""Greedy decoding with the KV cache and log-likelihood scoring against plain
uncached references, on a tiny random model (and a sentencepiece tokenizer
trained in the test)."""

from __future__ import annotations

import pytest
import torch
from evals_fixtures import make_model, make_tokenizer

from memlm.evals.scoring import (
    encode_pair,
    loglikelihoods,
    rolling_loglikelihoods,
    rolling_rows,
    score_rows,
)
from memlm.generation.decoding import (
    cut_at_stop,
    generate_texts,
    greedy_generate,
    length_batches,
    prompt_ids,
)

NO_EOS = -1  # an id the model never produces: decoding runs max_new_tokens steps


@pytest.fixture(scope="module")
def model():
    return make_model(max_seq_len=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """One prompt, no cache, no batching: the definition of greedy decoding."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def random_prompts(lengths, seed=0, vocab=384):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_cached_batched_greedy_equals_uncached_token_for_token(model, batch_size):
    prompts = random_prompts([5, 9, 5, 5, 12, 9, 1, 5])  # equal lengths share batches
    outs, truncated = greedy_generate(model, prompts, 20, NO_EOS, batch_size=batch_size)
    assert truncated == [False] * len(prompts)
    for prompt, out in zip(prompts, outs):
        assert out == reference_greedy(model, prompt, 20)
    uncached, _ = greedy_generate(model, prompts, 20, NO_EOS, batch_size=batch_size, use_cache=False)
    assert uncached == outs


@pytest.fixture(scope="module")
def memory_model():
    from memlm.config.run import compose
    from memlm.model import build_model

    cfg = compose(["model.vocab_size=384", "model.max_seq_len=64", "data.seq_len=16", "memory=memplus",
                   "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4", "memory.heads=2",
                   "memory.k_dim=32", "memory.layers=[1]"])
    return build_model(cfg.model, cfg.memory, seed=1).eval()


def test_cache_and_scoring_through_a_memory_layer(memory_model):
    prompts = random_prompts([6, 6, 3], seed=1)
    outs, _ = greedy_generate(memory_model, prompts, 10, NO_EOS, batch_size=4)
    assert outs == [reference_greedy(memory_model, p, 10) for p in prompts]
    rows = [(p + o[:-1], o) for p, o in zip(prompts, outs)]
    for (lp, greedy), (p, o) in zip(score_rows(memory_model, rows, batch_size=3), zip(prompts, outs)):
        assert lp == pytest.approx(manual_logprob(memory_model, p, o), abs=1e-4) and greedy


def test_length_batches_group_equal_lengths():
    assert length_batches([3, 5, 3, 5, 5, 2], 2) == [[1, 3], [4], [0, 2], [5]]


def test_rows_stop_at_eos_and_at_the_stop_check(model):
    prompts = random_prompts([7, 7, 7], seed=2)
    full = [reference_greedy(model, p, 12) for p in prompts]
    eos = full[0][3]  # the 4th token of row 0: decoding stops before it there
    outs, _ = greedy_generate(model, prompts, 12, eos, batch_size=3)
    for ref, out in zip(full, outs):
        expected = ref[:ref.index(eos)] if eos in ref else ref
        assert out == expected
    # A stop check ends each row right after the token that satisfies it, independently of the others.
    outs, _ = greedy_generate(model, prompts, 12, NO_EOS, batch_size=3,
                              should_stop=lambda toks: len(toks) >= 2 and toks[-1] % 2 == 0)
    for ref, out in zip(full, outs):
        even = [i for i, t in enumerate(ref) if i >= 1 and t % 2 == 0]
        assert out == (ref[:even[0] + 1] if even else ref)


def test_long_prompts_are_left_truncated_and_counted(model):
    long_prompt, short = random_prompts([80, 10], seed=3)
    outs, truncated = greedy_generate(model, [long_prompt, short], 8, NO_EOS)
    assert truncated == [True, False]
    assert outs[0] == reference_greedy(model, long_prompt[-(64 - 8):], 8)


def test_cut_at_stop():
    assert cut_at_stop("Paris\nQ: next", ["\n"]) == "Paris"
    assert cut_at_stop("a.b\nc", ["\n", "."]) == "a"
    assert cut_at_stop("no stop", ["\n"]) == "no stop"


def test_generate_texts_decodes_and_cuts(model, tokenizer):
    contexts = ["Q: Where was Ada born?\nA:", "Q: Who?\nA:"]
    texts, truncated = generate_texts(model, tokenizer, contexts, ["\n"], 10)
    assert truncated == [False, False]
    for context, text in zip(contexts, texts):
        raw = tokenizer.decode(reference_greedy(model, prompt_ids(tokenizer, context), 10))
        assert "\n" not in text and raw.startswith(text)


# ------------------------------------------------------------------ scoring
def manual_logprob(model, ctx: list[int], cont: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont[:-1]]))[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    return sum(logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_encode_pair_moves_trailing_spaces_to_the_continuation(tokenizer):
    ctx, cont = encode_pair(tokenizer, "Answer: ", "Paris")
    ctx2, cont2 = encode_pair(tokenizer, "Answer:", " Paris")
    assert (ctx, cont) == (ctx2, cont2)
    assert ctx[0] == tokenizer.eos_id and tokenizer.decode(ctx[1:] + cont) == "Answer: Paris"


def test_loglikelihood_batched_equals_unbatched_and_a_manual_sum(model, tokenizer):
    pairs = [("Question: What is 2+2?\nAnswer:", c) for c in (" 4", " four", " 22")]
    pairs += [("The capital of France is", " Paris."), ("Answer:", " A"), ("Answer:", " B")]
    batched, _ = loglikelihoods(model, tokenizer, pairs, batch_size=16)
    single, _ = loglikelihoods(model, tokenizer, pairs, batch_size=1)
    for (context, continuation), (lp_b, greedy_b), (lp_s, greedy_s) in zip(pairs, batched, single):
        ctx, cont = encode_pair(tokenizer, context, continuation)
        assert lp_b == pytest.approx(manual_logprob(model, ctx, cont), abs=1e-4)
        assert lp_b == pytest.approx(lp_s, abs=1e-4) and greedy_b == greedy_s


def test_is_greedy_flag(model):
    ctx = random_prompts([6], seed=4)[0]
    best = reference_greedy(model, ctx, 2)
    (lp, greedy), (_, not_greedy) = score_rows(model, [(ctx + best[:1], best), (ctx + [best[0]], [best[0] + 1, 5])])
    assert greedy and not not_greedy and lp < 0


@pytest.mark.parametrize("n, max_len, stride", [(1, 4, 0), (10, 4, 0), (8, 4, 0), (10, 4, 2), (11, 5, 3), (3, 8, 0)])
def test_rolling_windows_predict_every_token_once(n, max_len, stride):
    tokens = list(range(100, 100 + n))
    rows = rolling_rows(tokens, 1, max_len, stride)
    predicted = [t for _, targets in rows for t in targets]
    assert predicted == tokens
    full = [1, *tokens]
    for inputs, targets in rows:
        assert len(inputs) <= max_len and len(targets) <= len(inputs)
        start = full.index(inputs[0]) if inputs[0] != 1 else 0
        # each target follows its input prefix in the document
        assert full[start + len(inputs) - len(targets) + 1:start + len(inputs) + 1] == targets
        if stride and start > 0:
            assert len(inputs) - len(targets) >= max_len - stride  # sliding: context kept


def test_rolling_loglikelihood_of_a_short_text_is_its_full_sequence_logprob(model, tokenizer):
    text = "Ada Lovelace was born in London."
    (lp, count), = rolling_loglikelihoods(model, tokenizer, [text])
    tokens = tokenizer.encode(text)
    assert count == len(tokens)
    assert lp == pytest.approx(manual_logprob(model, [tokenizer.eos_id], tokens), abs=1e-4)
    # Longer than the 64-token context: non-overlapping windows, each summed by hand.
    long_text = " ".join([text] * 12)
    (lp_long, n_long), = rolling_loglikelihoods(model, tokenizer, [long_text])
    full = [tokenizer.eos_id, *tokenizer.encode(long_text)]
    assert n_long == len(full) - 1 > 2 * 64
    manual = sum(manual_logprob(model, full[i:i + 1], full[i + 1:i + 65]) for i in range(0, n_long, 64))
    assert lp_long == pytest.approx(manual, abs=1e-3)
