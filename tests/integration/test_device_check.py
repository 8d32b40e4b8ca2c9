"""bench/device_check.sh and the checks it runs can fail: for each section a
failure is injected on CPU (a kernel raising, a wrong output, a graph break,
recompiles, a compile speedup <= 1, an MFU under the floor, an `.item()` in
the step, 2 ranks off 1 process, no GPU) and the section reports FAIL with the
reason and a non-zero exit; and the dry run (tiny models on CPU) passes.

Two layers. Here: the script's own bookkeeping and the bench scripts'
functions called in this process with the failure patched in (fast; the
speed section's in test_device_check_gpu_speed.py). The script run end to
end (slow, minutes each): test_device_check_runs.py (a
failure injected into each section, the dry run) and
test_device_check_speed.py (the speed sections' dry run, wheels for the GPU
image).

    python -m pytest -q tests/integration/test_device_check*.py -m "slow or not slow"
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device_check_run import SCRIPT, load_bench, run_device_check, summary_line

kernels = load_bench("kernels")
device_train = load_bench("device_train")
nosync_watch = load_bench("nosync_watch")


# ------------------------------------------------------------ the script itself
def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_header_lists_every_section_with_its_rule():
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    for section in ("env", "kernel_tests", "kernel_bench", "mfu", "nosync", "compile_dense", "compile_memplus",
                    "paths", "equivalence", "speed_kernels", "speed_sweep", "speed_train", "speed_profile",
                    "speed_compiled"):
        assert f"#   {section} " in header, section
    assert header.count("FAIL:") >= 8  # a rule for each section (the two compile sections share one)


def test_failing_sections_are_recorded_and_the_rest_still_runs(tmp_path):
    # `false` as the Python: every section fails at once.
    result = run_device_check(tmp_path, PYTHON="false", SECTIONS="mfu nosync equivalence", DRY_RUN="1")
    assert result.returncode != 0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for section in ("mfu", "nosync", "equivalence"):
        assert any(line.startswith(section) and "FAIL (exit 1)" in line for line in summary.splitlines()), summary
    assert "failed sections: 3" in summary


def test_a_section_exiting_0_without_its_ok_line_fails(tmp_path):
    result = run_device_check(tmp_path, PYTHON="true", SECTIONS="mfu", DRY_RUN="1")
    assert result.returncode != 0
    assert "FAIL (no RESULT ok)" in summary_line(tmp_path, "mfu")


def test_env_fails_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_device_check(tmp_path, PYTHON=sys.executable, SECTIONS="env")
    assert result.returncode != 0
    line = summary_line(tmp_path, "env")
    assert "FAIL" in line and "RESULT env FAIL: missing a CUDA GPU" in line, line


# ----------------------------------------------------------------- kernel_bench
def _quick_bench(tmp_path, capsys) -> tuple[int, str, Path]:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    rc = kernels.main(["--quick", "--no-sweep", "--json", str(tmp_path / "k.json"), "--doc", str(doc)])
    return rc, capsys.readouterr().out, doc


def test_kernel_bench_fails_when_a_kernel_raises(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(kernels.ops, "embedding_bag", broken)
    rc, out, doc = _quick_bench(tmp_path, capsys)
    assert rc == 1
    result = out.strip().splitlines()[-1]
    assert result.startswith("RESULT kernel_bench FAIL") and "raised RuntimeError: CUDA error" in result, result
    assert doc.read_text() == "# Benchmarks\n"  # a failed run writes no figures
    assert json.loads((tmp_path / "k.json").read_text())["failures"]


def test_kernel_bench_fails_on_a_wrong_result(tmp_path, capsys, monkeypatch):
    right = kernels.ops.embedding_bag

    def off_by_one_percent(values, indices, weights, **kwargs):
        return right(values, indices, weights, **kwargs) * 1.01

    monkeypatch.setattr(kernels.ops, "embedding_bag", off_by_one_percent)
    rc, out, _ = _quick_bench(tmp_path, capsys)
    assert rc == 1
    result = out.strip().splitlines()[-1]
    # float32: 1% is far over 1e-4; bf16: 1% is within its 2e-2, the weight gradient is not touched.
    assert "RESULT kernel_bench FAIL: 2 failure(s): cpu float32 dense torch: output off by" in result, result


def test_kernel_bench_passes_and_writes_its_section(tmp_path, capsys):
    rc, out, doc = _quick_bench(tmp_path, capsys)
    assert rc == 0, out
    assert "RESULT kernel_bench ok" in out and "## Kernels (bench/kernels.py)" in doc.read_text()


def test_gpu_rows_record_raising_and_wrong_kernels_and_go_on():
    """The GPU loop (run here on CPU at a tiny shape, with a stand-in timer):
    a kernel name ops.embedding_bag rejects raises, a kernel off the
    reference is not timed, and the good ones are still measured."""
    failures = []
    shape = (64, 8, 512, 64)
    rows, _ = kernels.bench_gpu(shape, 1, False, failures, device="cpu",
                                kernels=("torch", "no-such-kernel", "F.embedding_bag"),
                                timer=lambda fn, repeats: fn() or 1e-3)
    assert [r["name"] for r in rows] == ["torch", "torch", "F.embedding_bag", "F.embedding_bag"]
    assert len(failures) == 1 and failures[0].startswith("cpu no-such-kernel raised"), failures


def test_a_baseline_without_bf16_weights_backward_is_timed_forward_only(monkeypatch):
    """CUDA's F.embedding_bag has no bf16 per-sample-weights backward (seen on
    an H200, torch 2.11): the baseline is checked and timed forward only, not
    counted a failure, and the table says so; our kernels still train."""
    monkeypatch.setattr(kernels, "trains_with_bf16_weights", lambda device: False)
    failures = []
    shape = (64, 8, 512, 64)
    rows, _ = kernels.bench_gpu(shape, 1, False, failures, device="cpu", kernels=("F.embedding_bag", "torch"),
                                timer=lambda fn, repeats: fn() or 1e-3)
    assert failures == []
    assert [(r["name"], r["pass_"]) for r in rows] == [("F.embedding_bag", "fwd"), ("torch", "fwd+bwd")]
    assert "timed forward only" in kernels.gpu_markdown(rows, [], shape)


# -------------------------------------------------------------------------- mfu
def test_judge_mfu_rules():
    ok = {"loss": 5.0, "mfu": 0.3}
    assert device_train.judge_mfu({"dense": ok}, 0.1, dry=False) == []
    low = device_train.judge_mfu({"dense": {**ok, "mfu": 0.04}}, 0.1, dry=False)
    assert low == ["dense: MFU 4.0% under the floor 10%"]
    assert "not finite" in device_train.judge_mfu({"dense": {**ok, "loss": float("nan")}}, 0.1, dry=False)[0]
    assert device_train.judge_mfu({"dense": {**ok, "mfu": None}}, 0.1, dry=True) == []  # CPU: no peak


def _as_if_on_a_gpu(monkeypatch):
    """device_train's GPU path (no --dry-run) on this CPU: CUDA reported
    present to its main, the GPU models replaced by the tiny CPU ones."""
    monkeypatch.setattr(device_train, "has_cuda", lambda: True)
    monkeypatch.setattr(device_train, "GPU_MODEL", device_train.TINY_MODEL)
    monkeypatch.setattr(device_train, "GPU_COMPILE_MODEL", device_train.TINY_MODEL)
    monkeypatch.setattr(device_train, "GPU_MEMPLUS", device_train.TINY_MEMPLUS)


def test_mfu_section_fails_under_the_floor(monkeypatch, capsys):
    """The GPU path with an H200's peak: a tiny model on CPU is far under 10%."""
    _as_if_on_a_gpu(monkeypatch)
    monkeypatch.setattr(device_train, "device_peak_flops", lambda device: 989e12)
    rc = device_train.main(["mfu"])
    result = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1
    assert result.startswith("RESULT mfu FAIL: dense: MFU 0.0% under the floor 10%; memplus: MFU"), result


def test_mfu_floor_must_be_a_fraction(capsys):
    with pytest.raises(SystemExit):
        device_train.main(["mfu", "--dry-run", "--mfu-floor", "10"])
    assert "valid is a fraction in [0, 1)" in capsys.readouterr().err


# ---------------------------------------------------------------------- compile
def _compile_with_aot_eager(monkeypatch):
    """parallel.compile=true with dynamo's graphs but no inductor (seconds, not minutes on CPU)."""
    import memlm.distributed.parallelize as parallelize

    def apply_compile(model):
        for block in model.layers:
            block.compile(backend="aot_eager")

    monkeypatch.setattr(parallelize, "apply_compile", apply_compile)


def test_judge_compile_rules():
    clean = {"graphs": 1, "graph_breaks": 0, "break_reasons": [], "frames": 1}
    assert device_train.judge_compile("dense", 1.0, 0.5, clean, dry=False) == []
    assert device_train.judge_compile("dense", 1.0, 1.0, clean, dry=False) == [
        "speedup 1.00x <= 1 (eager 1000.0 ms, compiled 1000.0 ms per step)"]
    assert device_train.judge_compile("dense", 1.0, 2.0, clean, dry=True) == []  # not judged on CPU
    breaks = device_train.judge_compile("dense", 1.0, 0.5, {**clean, "graph_breaks": 2, "graphs": 2,
                                                             "break_reasons": ["x"]}, dry=False)
    assert breaks[0].startswith("2 graph break(s), expected 0") and "recompiles" in breaks[1]
    assert device_train.judge_compile("memplus", 1.0, 0.5, {**clean, "graphs": 2}, dry=False) == []


def test_compile_section_counts_the_expected_graphs(monkeypatch, capsys):
    _compile_with_aot_eager(monkeypatch)
    for variant in ("dense", "memplus"):
        assert device_train.main(["compile", "--dry-run", "--variant", variant]) == 0
        result = capsys.readouterr().out.strip().splitlines()[-1]
        graphs = device_train.EXPECTED_GRAPHS[variant]
        assert result.startswith(f"RESULT compile_{variant} ok: {variant} ") and f", {graphs} graph(s), 0 break(s)" \
            in result, result


def test_compile_section_fails_on_a_graph_break(monkeypatch, capsys):
    from memlm.model.block import Block

    _compile_with_aot_eager(monkeypatch)
    forward = Block.forward

    def with_break(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", with_break)
    assert device_train.main(["compile", "--dry-run", "--variant", "dense"]) == 1
    result = capsys.readouterr().out.strip().splitlines()[-1]
    assert result.startswith("RESULT compile_dense FAIL: ") and "graph break(s), expected 0" in result, result


def test_compile_section_fails_on_recompiles(monkeypatch, capsys):
    """A Python int that changes every call: dynamo guards on it and recompiles."""
    from memlm.model.block import Block

    _compile_with_aot_eager(monkeypatch)
    forward, calls = Block.forward, [0]

    def recompiling(self, x, *args, **kwargs):
        calls[0] += 1
        return forward(self, x, *args, **kwargs) * (1.0 + 0.0 * calls[0])

    monkeypatch.setattr(Block, "forward", recompiling)
    assert device_train.main(["compile", "--dry-run", "--variant", "dense"]) == 1
    result = capsys.readouterr().out.strip().splitlines()[-1]
    assert "graphs compiled, expected at most 1 (recompiles)" in result, result


def test_compile_section_fails_when_compiled_is_not_faster(monkeypatch, capsys):
    """The GPU path, with step times given: compiled 1.25x slower than eager."""
    _as_if_on_a_gpu(monkeypatch)
    _compile_with_aot_eager(monkeypatch)
    measure = device_train.timed_steps

    def timed(trainer, warmup, steps, peak=None):
        out = measure(trainer, 0, 1, peak)
        return {**out, "step_s": 0.125 if trainer.cfg.parallel.compile else 0.1}

    monkeypatch.setattr(device_train, "timed_steps", timed)
    assert device_train.main(["compile", "--variant", "dense"]) == 1
    result = capsys.readouterr().out.strip().splitlines()[-1]
    assert result.startswith("RESULT compile_dense FAIL: speedup 0.80x <= 1 (eager 100.0 ms, compiled 125.0 ms"), \
        result


# ----------------------------------------------------------------------- nosync
def _small_trainer(tmp_path, *extra):
    from memlm.config.run import compose
    from memlm.train.trainer import Trainer

    return Trainer(compose([*device_train.COMMON, *device_train.TINY_MODEL, "model.n_layers=2", "data.seq_len=16",
                            "steps=4", "logging.every=1000", f"dump_dir={tmp_path}", *extra]))


def test_nosync_sees_an_item_in_the_step(tmp_path, monkeypatch):
    from memlm.train.trainer import Trainer

    forward_loss = Trainer._forward_loss

    def with_item(self, *args, **kwargs):
        loss = forward_loss(self, *args, **kwargs)
        loss.item()  # a host read: a sync on a GPU
        return loss

    monkeypatch.setattr(Trainer, "_forward_loss", with_item)
    result = nosync_watch.watch_fit(_small_trainer(tmp_path), cuda=False)
    # Steps 1-3 are watched (step 4 logs); each reads once.
    assert result["n_syncs"] == 3 and result["steps"] == 4, result
    assert result["syncs"][0].startswith("step 1: item at ") and "(with_item)" in result["syncs"][0]


def test_nosync_passes_a_clean_run_and_watches_only_non_logging_steps(tmp_path):
    trainer = _small_trainer(tmp_path, *device_train.TINY_MOE)
    assert nosync_watch.watch_fit(trainer, cuda=False) == {"steps": 4, "syncs": [], "n_syncs": 0}


def test_host_read_counter_on_a_gpu_counts_only_cuda_tensors():
    with nosync_watch.HostReadCounter(cuda=True) as reads:
        reads.armed = True
        torch.ones(2).sum().item()  # a CPU tensor: no device sync
        reads.armed = False
    assert reads.reads == []
    with nosync_watch.HostReadCounter(cuda=False) as reads:
        reads.armed = True
        torch.ones(2).sum().item()
        bool(torch.ones(()))
        reads.armed = False
    assert [r.split(" at ")[0] for _, r in reads.reads] == ["item", "__bool__"]
    assert torch.Tensor.item is not reads._counted  # restored
