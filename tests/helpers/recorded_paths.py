"""Three training paths whose figures are recorded, to show that a change to
the house (how the trainer, optimizer and model builder are put together)
leaves a run's numbers as they were, bit for bit.

    python tests/helpers/recorded_paths.py tests/records/paths.json   # record (one thread)

- `pretrain`: a fixed-seed Memory+ run on the synthetic biographies,
  validation during the run, the QA evaluation after it;
- `resume`: the same run stopped after half its steps and resumed;
- `finetune`: finetune=memory from the pretrain's final checkpoint, evaluated.

Each path gives its metrics.jsonl rows (losses and gradient norms as floats)
its summary's validation loss and evaluation figures, and the answers it
generated (greedy decoding: a change in a logit's last bit can change a token).
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

RUN = ["model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512",
       "model.multiple_of=32", "memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4",
       "memory.eval_knn=4", "memory.k_dim=32", "memory.heads=2", "data=synthetic", "data.seq_len=32",
       "data.micro_batch=4", "data.synthetic.people=12", "data.synthetic.docs_per_person=2", "eval=synthetic",
       "eval.num_fewshot=0", "eval.limit=12", "eval.after_training=true", "eval.log_samples=true",
       "data.val_fraction=0.2", "optim.warmup=2", "steps=8",
       "val_every=4", "val_batches=2", "checkpoint.every=4", "logging.every=1", "logging.wandb.mode=disabled"]
FIGURES = ("loss", "grad_norm", "value_grad_norm", "lr")


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: row[k] for k in ("step", *FIGURES) if k in row} for row in rows if "loss" in row]


def _summary(run: Path) -> dict:
    """The validation loss, the evaluation's figures and what the model answered to each question."""
    summary = json.loads((run / "summary.json").read_text())
    (samples,) = (run / "evals").glob("*_samples.jsonl")
    answers = [json.loads(line).get("prediction") for line in samples.read_text().splitlines()]
    return {"val_loss": summary.get("val_loss"), "evals": summary.get("evals"), "answers": answers}


def figures(root: Path) -> dict:
    from memlm.config.run import compose
    from memlm.train.trainer import Trainer

    torch.set_num_threads(1)
    cache = [f"data.cache_dir={root / 'cache'}"]
    out = {}
    pre = root / "pretrain"
    Trainer(compose([*RUN, *cache, f"dump_dir={pre}"])).fit()
    out["pretrain"] = {"rows": _rows(pre), **_summary(pre)}
    res = root / "resume"
    Trainer(compose([*RUN, *cache, f"dump_dir={res}"])).fit(stop_after=4)
    Trainer(compose([*RUN, *cache, f"dump_dir={res}", "resume=auto"])).fit()
    out["resume"] = {"rows": _rows(res), **_summary(res)}
    fine = root / "finetune"
    (ckpt,) = sorted((pre / "checkpoints").glob("step_*8"))
    Trainer(compose([*RUN, *cache, "finetune=memory", "memory.value_lr=1e-2", "steps=4", f"init_from={ckpt}",
                     f"dump_dir={fine}"])).fit()
    out["finetune"] = {"rows": _rows(fine), **_summary(fine)}
    return out


def machine() -> dict:
    """What the figures depend on besides the code: torch and the CPU's vector unit."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine()}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        record = {"machine": machine(), "paths": figures(Path(tmp))}
    Path(sys.argv[1]).write_text(json.dumps(record, indent=1) + "\n")
