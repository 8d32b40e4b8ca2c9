"""Text generation from a model in memory: the call behind `python -m memlm.generate`
(which loads the model from a path first, memlm.generate.load).

    from memlm.generation.text import generate

    done = generate(model, tokenizer, ["Q: Where was Ada Lovelace born?\\nA:"], max_new_tokens=32,
                    temperature=0.8, top_p=0.95, seed=0, stop=["\\n"])
    print(done[0].text)

Decoding is the evals' own (memlm.generation.decoding, KV cache, prompts grouped
by length, every prompt started with the eos token as in training), so a
greedy call (temperature=0, the default) returns exactly what the evals
generate for the same prompt; sampling only changes how the next token is
chosen (memlm.generation.sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from memlm.errors import ConfigError
from memlm.generation.decoding import decode_texts
from memlm.generation.sampling import Sampling


@dataclass
class Completion:
    prompt: str
    text: str  # the continuation, cut before the first stop string
    tokens: list[int]  # every generated token id (stop string included, eos not)
    finish_reason: str  # "eos", "stop" (a stop string appeared) or "length" (max_new_tokens)
    truncated: bool  # the prompt was left-truncated to fit model.max_seq_len - max_new_tokens

    def to_dict(self) -> dict:
        return asdict(self)


def check_request(model, max_new_tokens: int, batch_size: int, stop: Sequence[str]) -> None:
    """Generation arguments other than the sampling ones (Sampling.validate)."""
    max_len = model.args.max_seq_len
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens < max_len:
        raise ConfigError("max_new_tokens", max_new_tokens,
                          f"an integer in [1, {max_len - 1}] (below model.max_seq_len={max_len})")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("batch_size", batch_size, "an integer >= 1")
    if isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop):
        raise ConfigError("stop", stop, "a list of non-empty strings")


def generate(
    model,
    tokenizer,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str] = (),
    batch_size: int = 16,
    use_cache: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> list[Completion]:
    """One Completion per prompt, in order (a single string is one prompt).

    temperature=0: greedy; else sampled from softmax(logits / temperature),
    cut to the top_k tokens (0: no cut) and to the nucleus of mass top_p
    (1: no cut). `seed` makes sampled runs reproducible; each prompt has its
    own stream. A row ends at eos, at a stop string, or after max_new_tokens.
    use_cache=False recomputes every step without the KV cache (a reference)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    sampling = Sampling(temperature, top_k, top_p, seed)
    sampling.validate()
    check_request(model, max_new_tokens, batch_size, stop)
    was_training = model.training
    model.eval()
    try:
        texts, out = decode_texts(model, tokenizer, prompts, list(stop), max_new_tokens, batch_size, on_batch,
                                  sampling.picker(len(prompts)), use_cache)
    finally:
        model.train(was_training)
    return [Completion(p, t, tok, f, cut)
            for p, t, tok, f, cut in zip(prompts, texts, out.tokens, out.finish, out.truncated)]
