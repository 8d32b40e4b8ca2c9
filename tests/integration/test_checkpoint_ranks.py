"""Checkpoints on several ranks at scale (issue 28): async saves need a CPU
backend beside NCCL, and checksums are computed by every rank in parallel.

dcp.async_save runs its collectives on host tensors. On CPU the closest
emulation of an NCCL-only group is gloo registered for the cuda device type
alone ("cuda:gloo"): DCP sees no CPU backend, as it would with NCCL. The
trainer's backend string (memlm.distributed.env.process_group_backend),
with NCCL swapped for gloo since CPU has no NCCL, saves.
"""

from __future__ import annotations

import json

from checkpoint_rank_workers import async_save_on, hashed_bytes_per_rank
from distributed_workers import run_ranks

from memlm.distributed.env import process_group_backend


def test_the_trainer_group_has_a_cpu_backend_beside_nccl():
    assert process_group_backend(use_cuda=True) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(use_cuda=False) == "gloo"


def test_async_save_needs_a_cpu_backend_and_says_so(tmp_path):
    out = tmp_path / "cuda_only.json"
    run_ranks(async_save_on, 2, str(tmp_path / "a"), str(out), backend="cuda:gloo")
    outcome = json.loads(out.read_text())
    assert not outcome["ok"]
    assert "checkpoint.async_save=true needs a CPU backend" in outcome["error"] and "cuda only" in outcome["error"]
    assert not (tmp_path / "a" / "checkpoints").exists()  # refused before anything was written

    out = tmp_path / "with_cpu.json"
    run_ranks(async_save_on, 2, str(tmp_path / "b"), str(out),
              backend=process_group_backend(use_cuda=True).replace("nccl", "gloo"))
    assert json.loads(out.read_text()) == {"ok": True}
    assert (tmp_path / "b" / "checkpoints" / "step_00000001" / "meta.json").is_file()


def test_each_rank_hashes_about_a_quarter_of_the_checkpoint_on_4_ranks(tmp_path):
    """At publish and on resume=auto every rank runs crc32 over its own share of
    the files, in parallel (issue 28: rank 0 alone hashed a whole checkpoint
    between two barriers, and on resume every rank hashed every file)."""
    out = tmp_path / "hashed"
    run_ranks(hashed_bytes_per_rank, 4, str(tmp_path / "run"), str(out))
    counts = [json.loads((tmp_path / f"hashed.{r}").read_text()) for r in range(4)]
    total = counts[0]["total"]
    for phase in ("save", "resume"):
        per_rank = [c[phase] for c in counts]
        assert sum(per_rank) == total, (phase, per_rank, total)  # every byte once, by one rank
        assert max(per_rank) <= 0.35 * total, (phase, per_rank, total)  # about a quarter each
