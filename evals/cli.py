"""Command line of `python -m memlm.evals`."""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

from memlm.errors import ConfigError, entry_point

TOP_LEVEL = ("checkpoint", "out", "replace", "device", "tokenizer", "eval")

USAGE = """usage: python -m memlm.evals checkpoint=<path> [key=value ...]
       torchrun --nproc_per_node N -m memlm.evals checkpoint=<path> [key=value ...]

Evaluate a checkpoint (a checkpoint folder, a run's dump_dir: its newest
checkpoint, or an export folder) on a suite of tasks.

Top-level keys:
  checkpoint=<path>    required
  out=<file.json>      results file; default <run dump_dir>/evals/cli/<step>_<UTC time>.json,
                       a new file each time: the results the run wrote itself
                       (evals/<step>.json, read by sweep tables and reports) are
                       never replaced. Required for an export folder. The
                       markdown table is written next to it (.md).
  replace=true         let out= replace an earlier report of memlm.evals (its .json,
                       .md and samples file); any other file there is refused
  device=auto|cpu|cuda default auto (cuda when available)
  tokenizer=<path>     sentencepiece model, when the checkpoint names none
  eval=<preset>        a preset of configs/eval/ ({presets}); default none.
                       eval=run: the eval settings the run itself used (its
                       saved config), e.g. to re-evaluate it the same way

Every other key overrides a field of the eval config (eval.<key> also works):
  tasks=[nq_open,triviaqa,mmlu]   {tasks}
  data_dir=<dir>       root of the task folders (docs/evals.md shows the layout:
                       the original releases' JSONL/JSON/CSV files, or the
                       Hugging Face Parquet files as downloaded)
  limit=N              the first N examples of each task (0: all)
  num_fewshot=5        shots per prompt; task_fewshot.piqa=0 sets one task's
  max_new_tokens=32 batch_size=16 ppl_stride=0 log_samples=false
  wandb_mode=disabled|offline|online wandb_project=memlm

Under torchrun, rank r evaluates examples r::world_size (gloo) and rank 0
writes the results. Example:
  python -m memlm.evals checkpoint=runs/demo tasks=[synthetic_qa,mmlu] data_dir=evals_data limit=100
"""


def eval_presets() -> list[str]:
    import memlm.configs

    return sorted(p.stem for p in (Path(memlm.configs.__file__).parent / "eval").glob("*.yaml"))


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(top-level options, Hydra overrides of the eval group)."""
    top: dict[str, str] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError("argument", arg, "key=value (see python -m memlm.evals --help)")
        plus = "+" * (len(key) - len(key.lstrip("+")))
        key = key.lstrip("+").removeprefix("eval.")
        if key.startswith("task_fewshot."):
            plus = "++"  # a dict entry: added when new, replaced when the preset has it
        if key in TOP_LEVEL and not plus:
            top[key] = value
        else:
            overrides.append(f"{plus}eval.{key}={value}")
    if not top.get("checkpoint"):
        raise ConfigError("checkpoint", top.get("checkpoint", ""), "a checkpoint folder, run dump_dir or export folder")
    return top, overrides


def _device(name: str) -> str:
    import torch

    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError("device", name, "one of: auto, cpu, cuda")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if name == "cuda" else "cpu"


def check_paths(top: dict[str, str], samples: bool = False) -> None:
    """Everything about the paths on the command line that is known before the
    (possibly long) model load: the checkpoint exists, out= is a .json file an
    export needs whose report files (`samples`: with the samples file) replace
    only an earlier report, with replace=true, the tokenizer file exists."""
    from memlm.checkpoint.folder import missing_checkpoint
    from memlm.run.load import is_export_dir

    checkpoint = Path(top["checkpoint"])
    if not checkpoint.exists():  # a missing input: exit 1 from every command (export, generate, slot_usage)
        raise missing_checkpoint(checkpoint)
    export = is_export_dir(checkpoint)
    if top.get("replace", "false").lower() not in ("true", "false"):
        raise ConfigError("replace", top["replace"], "true or false")
    if top.get("out"):
        out = Path(top["out"])
        if out.suffix != ".json":
            raise ConfigError("out", top["out"], "a path ending in .json")
        if out.is_dir() or any(p.exists() and not p.is_dir() for p in out.parents):
            raise ConfigError("out", top["out"], "a .json file path whose folders are folders (or do not exist yet)")
        from memlm.evals.report import is_report, report_paths
        from memlm.files import check_output_file, check_output_path
        from memlm.run.load import resolve_checkpoint_dir

        check_output_path(out, {resolve_checkpoint_dir(checkpoint): "the model it evaluates"})
        replace = top.get("replace", "false").lower() == "true"
        for path in report_paths(out, samples).values():  # the .md (and samples) are the JSON's: replaced with it
            check_output_file(path, "report of memlm.evals", lambda _: is_report(out), "replace=true", replace)
    elif export:
        raise ConfigError("out", "", f"a .json path for the results ({checkpoint} is an export folder, not a run)")
    if top.get("tokenizer") and not Path(top["tokenizer"]).is_file():
        raise ConfigError("tokenizer", top["tokenizer"], "an existing sentencepiece .model file")
    if export and not top.get("tokenizer") and not (checkpoint / "tokenizer.model").is_file():
        raise ConfigError("tokenizer", "", f"the sentencepiece .model the model was trained with "
                                           f"({checkpoint} has no tokenizer.model)")


def _json_path(top: dict[str, str], loaded, step: int) -> tuple[Path, str]:
    """Where the results go (out= was checked by check_paths before the load)."""
    if top.get("out"):
        out = Path(top["out"])
        return out.parent, out.name
    source = Path(loaded.source)
    # <dump_dir>/checkpoints/step_N: the run folder as it is now, even if it moved since training.
    dump_dir = source.parent.parent if source.parent.name == "checkpoints" else Path(loaded.config.dump_dir)
    # Beside, never over, the run's own evals/<step>.json: a file per invocation.
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir, name, n = dump_dir / "evals" / "cli", f"{step}_{stamp}.json", 1
    while (out_dir / name).exists():
        n += 1
        name = f"{step}_{stamp}_{n}.json"
    return out_dir, name


def run_eval_config(checkpoint: str, overrides: list[str]):
    """`eval=run`: the eval config saved with the run's checkpoint, with the
    command line's `key=value` overrides on top, validated like a preset."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from memlm.checkpoint.checkpointer import CheckpointError, verify
    from memlm.config.run import from_yaml
    from memlm.run.load import resolve_checkpoint_dir

    directory = resolve_checkpoint_dir(checkpoint)
    try:
        saved = from_yaml(verify(directory, with_checksum=False)["config"])
    except CheckpointError as err:
        raise ConfigError("eval", "run",
                          f"a run checkpoint whose saved config holds its eval settings ({err})") from None
    dotlist = [o.lstrip("+").removeprefix("eval.") for o in overrides]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(saved.eval), OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException as err:
        raise ConfigError("overrides", dotlist, f"keys and values of the eval config ({err})") from None
    cfg = OmegaConf.to_object(merged)
    cfg.validate()
    return cfg


@entry_point
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        from memlm.config.eval_tasks import known_tasks

        print(USAGE.format(presets=", ".join(eval_presets()), tasks=known_tasks()))
        return 0
    return _run(argv)


def _run(argv: list[str]) -> int:
    from memlm.config.run import compose
    from memlm.data.tokenizer import Tokenizer
    from memlm.distributed.env import ProcessGroup
    from memlm.evals.suite import run_suite
    from memlm.evals.tasks import load_task
    from memlm.run.load import data_config, load_model

    start = time.perf_counter()
    top, overrides = parse_args(argv)
    preset = top.get("eval", "none")
    if preset == "run":
        eval_cfg = run_eval_config(top["checkpoint"], overrides)
    elif preset not in eval_presets():
        raise ConfigError("eval", preset, f"run, or one of the presets in configs/eval/: {', '.join(eval_presets())}")
    else:
        eval_cfg = compose([f"eval={preset}", *overrides]).eval  # validates every value, task names too
    if not eval_cfg.tasks:
        from memlm.config.eval_tasks import known_tasks

        raise ConfigError("tasks", [], f"a non-empty list, e.g. tasks=[nq_open,mmlu]; {known_tasks()}")
    device = _device(top.get("device", "auto"))
    check_paths(top, eval_cfg.log_samples)
    # Task files are read and checked before the (possibly long) model load; the
    # synthetic tasks ask about the training corpus the checkpoint's config names.
    data_cfg = data_config(top["checkpoint"])
    for name in eval_cfg.tasks:
        load_task(name, eval_cfg, data_cfg)
    # gloo even on GPUs: only per-example results (Python objects) are exchanged.
    with ProcessGroup(device.split(":")[0], backend="gloo") as env:
        if env.is_main:
            print(f"[eval] loading {top['checkpoint']} on {device}", flush=True)
        loaded = load_model(top["checkpoint"], device)
        tokenizer_path = top.get("tokenizer") or loaded.tokenizer_path
        if not tokenizer_path:
            raise ConfigError("tokenizer", "", f"the sentencepiece .model the model was trained with "
                                               f"({loaded.source} names none)")
        out_dir, json_name = _json_path(top, loaded, loaded.step)
        meta = {"checkpoint": str(loaded.source), "tokenizer": str(tokenizer_path)}
        results = run_suite(loaded.model, Tokenizer(str(tokenizer_path)), eval_cfg, loaded.step, out_dir, env.rank,
                            env.world_size, data_cfg=data_cfg,
                            json_name=json_name, meta=meta)
    if env.is_main:
        headline = "; ".join(
            f"{task} "
            + ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k not in ("n", "truncated", "tokens", "bytes"))
            for task, m in results.items() if "/" not in task
        )
        print(f"[eval] done: step {loaded.step}, {len(eval_cfg.tasks)} task(s) in "
              f"{time.perf_counter() - start:.1f}s: {headline} -> {out_dir / json_name}", flush=True)
    return 0
