"""Token choice for sampled generation: temperature, top-k, top-p, seed.

    pick = Sampling(temperature=0.8, top_p=0.9, seed=0).picker(n_prompts)
    decode(model, prompts, max_new_tokens, eos_id, pick=pick)   # memlm.generation.decoding

temperature=0 is greedy decoding (argmax, exactly the evals' choice). Each
prompt draws from its own generator, seeded from `seed` and the prompt's
index, so a prompt's completion does not depend on which other prompts share
its batch or on batch_size (up to float rounding between differently shaped
matmuls), and the same seed gives the same completions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memlm.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy; else logits / temperature before softmax
    top_k: int = 0  # keep the k most likely tokens; 0: all
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    seed: int = 0

    def validate(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError("temperature", t, "a finite number >= 0 (0: greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError("top_k", self.top_k, "an integer >= 0 (0: no top-k cut)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ConfigError("top_p", p, "a number in (0, 1] (1: no nucleus cut)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("seed", self.seed, "an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (batch, vocab) -> the sampling distribution (batch, vocab), float32."""
        # Subtracting the max first keeps a tiny temperature finite: the best token
        # scores exactly 0, every other one a large negative number (or -inf).
        logits = logits.float()
        z = (logits - logits.max(-1, keepdim=True).values) / self.temperature
        if 0 < self.top_k < z.shape[-1]:
            kth = z.topk(self.top_k, dim=-1).values[:, -1:]  # (batch, 1)
            z = z.masked_fill(z < kth, -math.inf)
        if self.top_p < 1:
            probs, order = torch.softmax(z, -1).sort(-1, descending=True)
            # Drop a token when the more likely ones already reach top_p; the best one is always kept.
            drop = probs.cumsum(-1) - probs >= self.top_p
            z = z.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        return torch.softmax(z, -1)

    def picker(self, n_prompts: int):
        """A `pick(logits (batch, vocab), prompt indices) -> (batch,)` for
        memlm.generation.decoding.decode; argmax when greedy."""
        from memlm.generation.decoding import argmax_pick

        self.validate()
        if self.greedy:
            return argmax_pick
        seeds = torch.randint(0, 2**62, (n_prompts,), generator=torch.Generator().manual_seed(self.seed)).tolist()
        generators: dict[int, torch.Generator] = {}

        def pick(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
            probs = self.probabilities(logits)  # (batch, vocab)
            chosen = []
            for r, i in enumerate(rows):
                if i not in generators:
                    generators[i] = torch.Generator(device=logits.device).manual_seed(seeds[i])
                chosen.append(torch.multinomial(probs[r], 1, generator=generators[i]))
            return torch.cat(chosen)  # (batch,)

        return pick
