"""Command line of `python -m memlm.generate` (the call is memlm.generate.generate).

    python -m memlm.generate runs/demo --prompt 'Q: Where was Ada Lovelace born?\\nA:' --stop '\\n'
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from memlm.errors import ConfigError, entry_point

DESCRIPTION = """Generate text from a memlm checkpoint (a checkpoint folder, a `latest` file,
a run's dump_dir: its newest checkpoint) or an export folder.

  python -m memlm.generate runs/demo --prompt 'Q: Where was Ada Lovelace born?\\nA:' --stop '\\n'
  python -m memlm.generate export/ --prompt-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 1 --json

Greedy by default (--temperature 0), exactly the evals' decoding: KV cache,
prompts batched by token length, each prompt started with the eos token as in
training. In --prompt, --stop and text prompt files, \\n, \\t and \\\\ stand for
a newline, a tab and a backslash. Completions go to stdout (one JSON object a
line with --json); progress and the summary go to stderr. Details: docs/generation.md.
"""

ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    """'a\\\\nb' (as typed in a shell) -> 'a\\nb'; unknown escapes stay as typed."""
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memlm.generate", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint folder, `latest` file, run dump_dir or export folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                   help="prompts, one a line; a .jsonl file holds {\"prompt\": ...} objects (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all, default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off, default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string: the completion ends before it (repeatable)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default 16)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto: cuda when available)")
    p.add_argument("--tokenizer", default=None, help="sentencepiece .model, when the checkpoint names none")
    p.add_argument("--json", action="store_true", help="one JSON object per completion on stdout")
    return p


def read_prompt_file(path: str) -> tuple[list[str], int]:
    """(prompts, blank lines skipped) of a prompt file."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("--prompt-file", path, f"a readable UTF-8 text or .jsonl file ({err})") from None
    prompts, blank = [], 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            blank += 1
            continue
        if file.suffix != ".jsonl":
            prompts.append(unescape(line))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError("--prompt-file", f"{path}:{number}", f"one JSON object a line ({err})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(prompt, str):
            raise ConfigError("--prompt-file", f"{path}:{number}", 'an object with a "prompt" string, or a string')
        prompts.append(prompt)
    return prompts, blank


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # argparse: usage errors exit 2
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from memlm.checkpoint.folder import missing_checkpoint
    from memlm.evals.cli import _device
    from memlm.generate import load
    from memlm.generation.sampling import Sampling
    from memlm.generation.text import check_request, generate

    start = time.perf_counter()
    # Every argument is checked before the (possibly long) model load.
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.validate()
    stop = [unescape(s) for s in args.stop]
    prompts, blank = [unescape(p) for p in args.prompt], 0
    for path in args.prompt_file:
        more, skipped = read_prompt_file(path)
        prompts += more
        blank += skipped
    if not prompts:
        raise ConfigError("--prompt", "", "at least one --prompt, or a --prompt-file holding prompts")
    if args.max_new_tokens < 1:
        raise ConfigError("max_new_tokens", args.max_new_tokens, "an integer >= 1")
    device = _device(args.device)
    if not Path(args.checkpoint).exists():  # a missing input: exit 1 from every command
        raise missing_checkpoint(args.checkpoint)
    print(f"[generate] loading {args.checkpoint} on {device}", file=sys.stderr, flush=True)
    model, tokenizer = load(args.checkpoint, device, args.tokenizer)
    check_request(model, args.max_new_tokens, args.batch_size, stop)
    with tqdm(total=len(prompts), desc="[generate]", unit="prompt", file=sys.stderr, dynamic_ncols=True) as bar:
        done = generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, temperature=sampling.temperature,
                        top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed, stop=stop,
                        batch_size=args.batch_size, on_batch=bar.update)
    for i, c in enumerate(done):
        if args.json:
            print(json.dumps({"index": i, **c.to_dict()}, ensure_ascii=False))
        else:
            if len(done) > 1:
                print(f"--- {i + 1}/{len(done)}: {c.prompt!r}")
            print(c.text)
    seconds = time.perf_counter() - start
    new_tokens = sum(len(c.tokens) for c in done)
    finish = ", ".join(f"{r} {sum(c.finish_reason == r for c in done)}" for r in ("eos", "stop", "length"))
    mode = "greedy" if sampling.greedy else (f"sampled (temperature {sampling.temperature}, top_k {sampling.top_k}, "
                                             f"top_p {sampling.top_p}, seed {sampling.seed})")
    notes = "".join([f"; {sum(c.truncated for c in done)} prompt(s) left-truncated to fit the context"
                     if any(c.truncated for c in done) else "",
                     f"; {blank} blank prompt-file line(s) skipped" if blank else ""])
    print(f"[generate] done: {len(done)} completion(s), {mode}, {new_tokens} new tokens in {seconds:.1f}s; "
          f"finish: {finish}{notes}", file=sys.stderr, flush=True)
    return 0
