"""The README demo: the largest end-to-end path memlm has, on CPU in minutes.

    python -m memlm.launch.demo [hydra overrides]

Today: compose `experiment=demo`, build the model on meta and initialize it,
train it on a copy task (each sequence repeats a random prefix, so the loss of
the second half can fall to ~0 once attention learns to look back), then
greedy-decode continuations with the KV cache and report copy accuracy.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from memlm.model import build_model
from memlm.train.config import compose


def copy_batch(batch: int, half: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    prefix = torch.randint(3, min(vocab, 35), (batch, half), generator=gen)  # 32 symbols
    return torch.cat([prefix, prefix], dim=1)  # (batch, 2 * half)


def main(argv: list[str] | None = None) -> int:
    overrides = ["experiment=demo", *(sys.argv[1:] if argv is None else argv)]
    cfg = compose(overrides)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.memory, seed=cfg.seed)
    counts = model.num_params()
    print(f"[demo] model {cfg.model.name}: {counts['total']:,} parameters "
          f"({counts['dense']:,} dense, {counts['embedding']:,} embedding, {counts['memory']:,} memory)")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    gen = torch.Generator().manual_seed(cfg.data.seed)
    half = cfg.data.seq_len // 2
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        tokens = copy_batch(cfg.data.micro_batch, half, cfg.model.vocab_size, gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == cfg.steps:
            print(f"[demo] step {step}/{cfg.steps}  loss {loss.item():.3f}  {time.perf_counter() - start:.1f}s")
    model.eval()
    tokens = copy_batch(16, half, cfg.model.vocab_size, gen)
    cache = model.new_cache(batch=16, max_len=2 * half)
    with torch.no_grad():
        logits = model(tokens[:, :half + 1], cache=cache)
        out = [logits[:, -1].argmax(-1)]
        for _ in range(half - 2):
            out.append(model(out[-1][:, None], cache=cache)[:, -1].argmax(-1))
    predicted = torch.stack(out, dim=1)
    accuracy = (predicted == tokens[:, half + 1:]).float().mean().item()
    print(f"[demo] greedy copy accuracy with the KV cache: {accuracy:.1%} of {predicted.numel()} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
