"""The `eval` section of the run config (the `eval/` Hydra config group): which
tasks the harness (memlm.evals) runs, when, and how.

    from memlm.config.eval import EvalConfig
    EvalConfig(tasks=["nq_open"], data_dir="evals_data").validate()  # ConfigError on a bad value

It lives in config/, below the harness, because `compose()` validates it in
every process: it stays free of torch, and task names are checked against
the task table (memlm.config.eval_tasks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memlm.config.eval_tasks import task_spec
from memlm.errors import ConfigError

WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    data_dir: str = ""  # root of the task folders (nq_open/, triviaqa/, mmlu/, ...)
    num_fewshot: int = 5
    limit: int = 0  # 0 -> every example; N -> the first N examples of each task
    after_training: bool = False
    every: int = 0  # 0 -> only after training
    # Per-task shot counts overriding num_fewshot, e.g. {piqa: 0, hellaswag: 0}.
    task_fewshot: dict[str, int] = field(default_factory=dict)
    max_new_tokens: int = 32  # generative tasks: greedy tokens per answer at most
    stop: list[str] = field(default_factory=lambda: ["\n"])  # generation ends at the first of these
    batch_size: int = 16  # prompts decoded / sequences scored per forward pass
    ppl_stride: int = 0  # perplexity window stride in tokens; 0 -> model.max_seq_len (non-overlapping)
    log_samples: bool = False  # also write every prompt, prediction and score to <step>_samples.jsonl
    wandb_mode: str = "disabled"  # disabled | offline | online (logs into the active run if any)
    wandb_project: str = "memlm"

    def fewshot_for(self, task: str) -> int:
        return self.task_fewshot.get(task, self.num_fewshot)

    def validate(self, prefix: str = "eval") -> None:
        for key in ("num_fewshot", "limit", "every", "ppl_stride"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "an integer >= 0")
        for key in ("max_new_tokens", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "an integer >= 1")
        for name in self.tasks:
            task_spec(name, f"{prefix}.tasks")
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"{prefix}.tasks", list(self.tasks), "a list without repeated task names")
        for name, shots in self.task_fewshot.items():
            task_spec(name, f"{prefix}.task_fewshot")
            if shots < 0:
                raise ConfigError(f"{prefix}.task_fewshot.{name}", shots, "an integer >= 0")
        if any(not s for s in self.stop):
            raise ConfigError(f"{prefix}.stop", list(self.stop), "a list of non-empty strings")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"{prefix}.wandb_mode", self.wandb_mode, f"one of: {', '.join(WANDB_MODES)}")
