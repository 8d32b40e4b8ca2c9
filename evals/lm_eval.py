"""lm-eval adapter: memlm checkpoints as the lm-eval model `memlm` (optional extra `lmeval`).

    pip install 'memlm[lmeval]'
    python -m memlm.evals.lm_eval --model memlm --model_args checkpoint=runs/demo \\
        --tasks my_task --include_path my_tasks/

`python -m memlm.evals.lm_eval` is lm-eval's own command line (the same
arguments as `lm_eval`) with this module imported first: lm-eval finds models
through its registry, which only knows `memlm` once this module has run. In
Python, import this module and pass `model="memlm"` (or a `MemLM` instance) to
`lm_eval.simple_evaluate`.

Model arguments (--model_args): checkpoint (a checkpoint folder, run dump_dir
or export folder, loaded with `memlm.run.load.load_model`), tokenizer
(default: the run's), max_gen_toks (default 256, as lm-eval's models); any
other key is refused (a misspelled argument would otherwise be ignored). The
batch size and device come from lm-eval's own --batch_size (a number; "auto"
means 16) and --device (falls back to the CPU when CUDA is missing). The
requests go through the same decoding and scoring functions as
`python -m memlm.evals`, so a task given to both gets the same numbers
(tests/integration/test_evals_lm_eval.py checks this).
"""

from __future__ import annotations

import sys
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from memlm.errors import entry_point
from memlm.evals.lockstep import Lockstep
from memlm.evals.scoring import loglikelihoods, rolling_loglikelihoods
from memlm.generation.decoding import generate_texts

DEFAULT_MAX_GEN_TOKS = 256
MODEL_ARGS = ("checkpoint", "tokenizer", "max_gen_toks")
# What lm-eval's evaluator adds to --model_args from its own options.
LM_EVAL_ARGS = ("batch_size", "max_batch_size", "device")


def _int_or_default(value: Any, default: int) -> int:
    # lm-eval passes batch_size as given on its command line: an int, a digit string, or "auto".
    if value is None or str(value).startswith("auto"):
        return default
    return int(value)


@register_model("memlm")
class MemLM(LM):
    def __init__(self, checkpoint: str | None = None, tokenizer: str | None = None, device: str | None = "auto",
                 batch_size: int | str | None = 16, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 model: Any = None, max_batch_size: Any = None, **unknown: Any):
        """Either `checkpoint` (and optionally `tokenizer`), or an already loaded
        `model` with a `tokenizer` object (in-process use, e.g. from the trainer).
        max_batch_size (lm-eval's, for batch_size=auto) is accepted and unused:
        the batch size is fixed."""
        super().__init__()
        if unknown:
            raise ValueError(f"memlm: unknown --model_args {', '.join(f'{k}={v!r}' for k, v in unknown.items())}; "
                             f"valid: {', '.join(MODEL_ARGS)} (and lm-eval's own --{', --'.join(LM_EVAL_ARGS)})")
        import torch

        if model is None:
            if not checkpoint:
                raise ValueError("memlm: pass --model_args checkpoint=<checkpoint folder, run dump_dir or export>")
            from memlm.data.tokenizer import Tokenizer
            from memlm.run.load import load_model

            if device in (None, "auto") or (str(device).startswith("cuda") and not torch.cuda.is_available()):
                # lm-eval's command line asks for cuda:0 unless told otherwise; like its HF model, fall back.
                if device not in (None, "auto"):
                    print(f"memlm: device {device} is not available, using the CPU", file=sys.stderr)
                device = "cuda" if torch.cuda.is_available() else "cpu"
            loaded = load_model(checkpoint, device)
            path = tokenizer or loaded.tokenizer_path
            if not path:
                raise ValueError(f"memlm: {checkpoint} names no tokenizer; pass --model_args tokenizer=<.model>")
            model, tokenizer = loaded.model, Tokenizer(str(path))
        elif tokenizer is None or isinstance(tokenizer, str):
            raise ValueError("memlm: with model=..., pass the Tokenizer object as tokenizer=...")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = _int_or_default(batch_size, 16)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def max_length(self) -> int:
        return self.model.args.max_seq_len

    def _bar(self, total: int | None, what: str) -> tqdm:
        return tqdm(total=total, desc=f"memlm {what}", file=sys.stderr, disable=self.rank != 0)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [req.args for req in requests]
        with self._bar(len(pairs), "loglikelihood") as bar:
            results, _ = loglikelihoods(self.model, self.tokenizer, pairs, self.batch_size, bar.update)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        # Counted in windows of max_length tokens (known once the texts are tokenized), batch by batch.
        with self._bar(None, "loglikelihood_rolling (windows)") as bar:
            scored = rolling_loglikelihoods(self.model, self.tokenizer, texts, 0, self.batch_size, bar.update,
                                            lambda n: bar.reset(total=n))
        return [logprob for logprob, _ in scored]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        # Requests with the same stop sequences and length limit are decoded together.
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(self._generation_key(req.args[1]), []).append(i)
        outputs: list[str] = [""] * len(requests)
        with self._bar(len(requests), "generate_until") as bar:
            for (until, max_new), idx in groups.items():
                contexts = [requests[i].args[0] for i in idx]
                texts, _ = generate_texts(self.model, self.tokenizer, contexts, list(until), max_new,
                                          self.batch_size, bar.update, lock=Lockstep.of(self.model))
                for i, text in zip(idx, texts):
                    outputs[i] = text
        return outputs

    def _generation_key(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int]:
        kwargs = dict(gen_kwargs or {})
        if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
            raise ValueError(f"memlm decodes greedily only; got generation_kwargs {gen_kwargs}")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        # The prompt keeps at least one token: cap the new tokens below the context length.
        return tuple(until), min(max_new, self.max_length - 1)


@entry_point
def main() -> int:
    """lm-eval's command line, with the `memlm` model registered (a memlm fault loading the model: one line)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
