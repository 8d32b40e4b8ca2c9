"""The training step never waits on the host: no device value is read in a
non-logging step, and the collectives per step do not grow with the model.

Host reads are counted by patching the Tensor methods that bring a value to
the host (`item`, `tolist`, `cpu`, `numpy`, `__bool__`, `__float__`,
`__int__`, `__index__`) while `Trainer.fit` runs with only its last step
logging. On CPU such a read costs nothing, on a GPU each one is a sync; the
test holds CPU runs to the GPU rule, so a read added anywhere in the step
(trainer, loader, model, optimizer, clipping) fails it.
"""

from __future__ import annotations

import json

import pytest
import torch
from distributed_workers import run_ranks
from host_reads import BASE, MEMPLUS, MOE, allowed, count_host_reads
from step_workers import collectives_per_step

from memlm.config.run import compose
from memlm.train.trainer import Trainer

ENGRAM = [*MEMPLUS, "memory.engram.layers=[0]", "memory.engram.heads=2", "memory.engram.head_dim=8"]


@pytest.mark.parametrize("model", [MEMPLUS, MOE, ENGRAM], ids=["memplus", "moe", "engram"])
def test_no_host_read_in_non_logging_steps(tmp_path, monkeypatch, model):
    steps = 5
    trainer = Trainer(compose([*BASE, *model, f"steps={steps}", "logging.every=1000", f"dump_dir={tmp_path}"]))
    reads = count_host_reads(trainer, monkeypatch)
    # Reads tagged step s < steps - 1 happen in steps 1 .. steps - 1 (none logs).
    in_steps = [r for s, r in reads if s < steps - 1 and not allowed(r)]
    assert in_steps == [], "host reads in non-logging steps:\n" + "\n".join(in_steps)
    # The counter sees reads: the logging step (the last one) makes some.
    assert any(s >= steps - 1 for s, _ in reads)


def test_the_host_read_counter_sees_the_old_per_step_reads(tmp_path, monkeypatch):
    """The counter would have failed the old step: a read per step makes it report."""
    steps = 4
    trainer = Trainer(compose([*BASE, *MEMPLUS, f"steps={steps}", "logging.every=1000", f"dump_dir={tmp_path}"]))
    step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda read=False: step(read=True))  # as before: read every step
    reads = count_host_reads(trainer, monkeypatch)
    assert any(s < steps - 1 and "tolist" in r for s, r in reads)


def test_collectives_per_step_do_not_grow_with_depth(tmp_path):
    """Collectives issued in a non-logging training step on 2 gloo ranks
    (besides FSDP's own per-block parameter traffic, which it issues through
    ProcessGroup methods), for 2- and 8-layer models.

    Measured on the step before this change (clip_ reduced each parameter's
    norm with its own all-reduce; the preemption flag was all-reduced every
    step): dense 2 layers 23, dense 8 layers 77; Memory+ (memory_parallel=2,
    one memory layer) 31 and 85. Now: dense 2 (the loss and one norm),
    Memory+ 8 (its memory read's 5, the loss, one dense and one value norm)."""
    memory = [*MEMPLUS, "parallel.memory_parallel=2"]
    runs = {f"{kind}{n}": [*BASE, f"model.n_layers={n}", *(memory if kind == "memplus" else []),
                           f"dump_dir={tmp_path / f'{kind}{n}'}"]
            for kind in ("dense", "memplus") for n in (2, 8)}
    out = tmp_path / "counts.json"
    run_ranks(collectives_per_step, 2, runs, str(out))
    counts = {name: len(r["other"]) for name, r in json.loads(out.read_text()).items()}
    assert counts["dense2"] == counts["dense8"] == 2, counts
    assert counts["memplus2"] == counts["memplus8"] == 8, counts
    assert counts["dense8"] < 77 and counts["memplus8"] < 85


def test_batches_go_to_cuda_from_pinned_memory_without_blocking(monkeypatch):
    """to_device: on CUDA each tensor is pinned, then copied with
    non_blocking=True (recorded with the two methods patched: no GPU here);
    on CPU the batch is returned as it is."""
    from memlm.train.data_source import to_device

    batch = (torch.arange(6).view(2, 3), torch.arange(6).view(2, 3) + 1)
    assert all(a is b for a, b in zip(to_device(batch, torch.device("cpu")), batch))
    calls = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", str(a[0]), k)) or self)
    to_device(batch, torch.device("cuda", 0))
    assert calls == ["pin", ("to", "cuda:0", {"non_blocking": True})] * 2


def test_clip_over_gradients_on_two_meshes_equals_plain_clipping(tmp_path):
    """The memory values live on another mesh than the dense weights: their
    norms are reduced per mesh and combined; the result is the plain norm of
    the full gradients, and each gradient is scaled by max_norm / norm."""
    from step_workers import clip_on_two_meshes

    out = tmp_path / "clip.pt"
    run_ranks(clip_on_two_meshes, 2, str(out))
    got = torch.load(out, weights_only=True)
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in got["full"]]))
    torch.testing.assert_close(got["norm"], want, rtol=1e-6, atol=0)
    for clipped, g in zip(got["clipped"], got["full"]):
        torch.testing.assert_close(clipped, g * (1.0 / (want + 1e-6)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clip_group_equals_torch_clip_grad_norm(max_norm):
    """clip_group_ on plain gradients against torch.nn.utils.clip_grad_norm_
    (the reference), and a sparse gradient against its dense equal."""
    from memlm.distributed.clip import clip_group_

    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, q in zip(ours, ref):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    norm = clip_group_(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm > 0 else float("inf"))
    torch.testing.assert_close(norm, want)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad)
    if 0 < max_norm < float(want):  # clipping happened
        assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours])) <= max_norm * (1 + 1e-5)
    # Sparse (memory.sparse_updates): rows 1 and 3 read, row 1 twice.
    table = torch.nn.Parameter(torch.zeros(5, 4))
    dense = torch.nn.Parameter(torch.zeros(5, 4))
    rows, values = torch.tensor([[1, 3, 1]]), torch.randn(3, 4, generator=gen)
    table.grad = torch.sparse_coo_tensor(rows, values, (5, 4))
    dense.grad = table.grad.to_dense()
    torch.testing.assert_close(clip_group_([table], max_norm), clip_group_([dense], max_norm))
    torch.testing.assert_close(table.grad.to_dense(), dense.grad)
