"""memlm.evals: the evaluation harness (generative QA, multiple choice, perplexity).

Command line (see `python -m memlm.evals --help` and docs/evals.md):

    python -m memlm.evals checkpoint=runs/demo tasks=[nq_open,triviaqa,mmlu] data_dir=evals_data

Python API, used by the trainer during and after training:

    run_suite(model, tokenizer, eval_cfg, step, out_dir, rank=0, world_size=1,
              *, data_cfg=None, json_name=None, meta=None) -> dict

- `model`: a `memlm.model.Transformer`, whole on this rank or sharded as it
  trains (FSDP2, memory-parallel value tables): then the ranks, which run
  different examples, keep their forward passes matched (memlm/evals/lockstep.py)
  and every rank must call run_suite. It is put in eval mode and its previous
  train/eval mode is restored on return. Any device; it computes in whatever
  precision the caller sets (the trainer: the run's autocast / FSDP policy).
- `tokenizer`: a `memlm.data.tokenizer.Tokenizer` (encode, decode, eos_id).
- `eval_cfg`: a `memlm.config.eval.EvalConfig` (the `eval` section of the run
  config); it is validated first. `tasks` must be non-empty.
- `step`: the training step, written into the report and its file name.
- `out_dir`: folder for the report, normally `<dump_dir>/evals`: rank 0 writes
  `<out_dir>/<step>.json` (or `json_name`), the markdown table `<step>.md`
  next to it, and `<step>_samples.jsonl` with `eval.log_samples=true`.
  None writes nothing (the table is still printed).
- `rank`, `world_size`: with world_size > 1, torch.distributed must be
  initialized; rank r evaluates examples r::world_size and the per-example
  results are gathered with `all_gather_object`, so every rank returns the same
  dict, equal to a one-process run. Every rank must call run_suite.
- `data_cfg`: the run's `DataConfig` (`memlm.run.load.data_config(path)`
  reads it from a checkpoint or an export); the synthetic_qa tasks ask the
  questions of the synthetic corpus the model was trained on, and are refused
  without one.
- `meta`: extra JSON fields (e.g. the checkpoint path).

Returns `{task: {metric: value, ..., "n": examples}}`: generative QA gives
`exact_match`, `f1`; multiple choice `acc`, `acc_norm`; MMLU `acc` (micro),
`acc_macro` and one `mmlu/<subject>` entry per subject; perplexity tasks
`token_ppl`, `bits_per_byte`, `tokens`, `bytes`. QA and multiple-choice entries
also count prompts left-truncated to fit the context (`truncated`). Synthetic
QA questions name their template: those tasks add `phrasings` (how many) and
`phrasings_em50` (the share of phrasings with exact match >= 50%), and the
written report (JSON `by_phrasing`, a markdown table) has exact match per
phrasing. Missing or malformed task files raise `TaskDataError` (naming the
path and the expected format) before any example is evaluated; unknown task
names raise `ConfigError` listing the known tasks.

Generation on free-form prompts (greedy or sampled, the same decoding):
`memlm.generation.text`, `python -m memlm.generate` (docs/generation.md).

Importing this package needs neither lm-eval nor torch at import time;
`memlm.evals.lm_eval` is the optional lm-eval adapter (the `lmeval` extra).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TaskDataError", "run_suite"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (its CLI's --help, a task error's type) pulls
    # in neither torch, the model nor the data pipeline.
    if name == "run_suite":
        from memlm.evals.suite import run_suite

        return run_suite
    if name == "TaskDataError":
        from memlm.evals.formats import TaskDataError

        return TaskDataError
    raise AttributeError(f"module 'memlm.evals' has no attribute {name!r}")
