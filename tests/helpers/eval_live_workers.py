"""Rank function of tests/integration/test_eval_live.py: a training run with evaluation,
measuring what the evaluation holds in memory on each rank."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from memlm.config.run import compose
from memlm.model import Transformer
from memlm.train.evaluation import Evaluation
from memlm.train.trainer import Trainer


def tensor_bytes() -> int:
    """Bytes of every tensor storage the process holds from Python, each storage once."""
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [obj for obj in objects if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.is_meta:
            continue
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        storage = local.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def fit_measuring_eval(rank: int, overrides: list[str], out_dir: str) -> None:
    """Train; during each evaluation, sample the tensor bytes at the end of every
    forward of a whole model and write the largest rise over the bytes held
    when the evaluation started, with the full model's fp32 size."""
    evaluate = Evaluation.run
    rises: list[int] = []
    samples = [0]

    def measured(self, *args, **kwargs):
        before = tensor_bytes()
        peak = [before]

        def sample(module, inputs, output):
            if isinstance(module, Transformer):  # FSDP2's subclass of it too
                peak[0] = max(peak[0], tensor_bytes())
                samples[0] += 1

        handle = torch.nn.modules.module.register_module_forward_hook(sample)
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            handle.remove()
            rises.append(peak[0] - before)

    Evaluation.run = measured
    trainer = Trainer(compose(overrides))
    model_bytes = sum(p.numel() * 4 for p in trainer.model.parameters())  # DTensor numel: the whole tensor
    trainer.fit()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rises": rises, "samples": samples[0],
                                                                     "model_bytes": model_bytes}))
