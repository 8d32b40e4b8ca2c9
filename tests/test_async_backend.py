"""checkpoint.async_save on several GPUs needs a CPU backend beside NCCL (issue 28).

dcp.async_save runs its collectives on host tensors. On CPU the closest
emulation of an NCCL-only group is gloo registered for the cuda device type
alone ("cuda:gloo"): DCP sees no CPU backend, as it would with NCCL. The
trainer's backend string (memlm.train.distributed.process_group_backend),
with NCCL swapped for gloo since CPU has no NCCL, saves.
"""

from __future__ import annotations

import json

from async_backend_workers import async_save_on
from distributed_workers import run_ranks

from memlm.train.distributed import process_group_backend


def test_the_trainer_group_has_a_cpu_backend_beside_nccl():
    assert process_group_backend(use_cuda=True) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(use_cuda=False) == "gloo"


def test_async_save_needs_a_cpu_backend_and_says_so(tmp_path):
    out = tmp_path / "cuda_only.json"
    run_ranks(async_save_on, 2, "cuda:gloo", str(tmp_path / "a"), str(out))
    outcome = json.loads(out.read_text())
    assert not outcome["ok"]
    assert "checkpoint.async_save=true needs a CPU backend" in outcome["error"] and "cuda only" in outcome["error"]
    assert not (tmp_path / "a" / "checkpoints").exists()  # refused before anything was written

    out = tmp_path / "with_cpu.json"
    run_ranks(async_save_on, 2, process_group_backend(use_cuda=True).replace("nccl", "gloo"), str(tmp_path / "b"),
              str(out))
    assert json.loads(out.read_text()) == {"ok": True}
    assert (tmp_path / "b" / "checkpoints" / "step_00000001" / "meta.json").is_file()
