"""bench/device_check.sh and the checks it runs can fail: for each section a
failure is injected on CPU (a kernel raising, a wrong output, a graph break,
recompiles, a compile speedup <= 1, an MFU under the floor, an `.item()` in
the step, 2 ranks off 1 process, no GPU) and the section reports FAIL with the
reason and a non-zero exit; and the dry run (tiny models on CPU) passes.

Two layers. Here: the script's own bookkeeping and the bench scripts'
functions called in this process with the failure patched in (fast). The
script run end to end (slow, minutes each): test_device_check_runs.py (a
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
gpu_speed = load_bench("gpu_speed")
speed_kernels = load_bench("speed_kernels")
speed_profile = load_bench("speed_profile")
launch_sweep = load_bench("launch_sweep")


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


# ----------------------------------------------------- speed (bench/gpu_speed.py)
def test_speed_check_records_ours_as_failures_and_the_official_as_notes():
    """A wrong or raising kernel of ours fails the kernels part; the official
    kernel's problems are reported beside it, not as ours; neither is timed."""
    values, indices, weights, grad_out = kernels.make_case((8, 4, 32, 16), torch.bfloat16, "cpu")
    ref = kernels.reference((values, indices, weights, grad_out))
    right = ref[0].to(torch.bfloat16)

    def timer(fn, repeats):
        return 1e-3

    failures, notes = [], []
    assert kernels.measure("fwd good", lambda: right, ref, (0,), timer, 1, failures, notes, True) == 1e-3
    assert kernels.measure("fwd ours", lambda: right * 1.1, ref, (0,), timer, 1, failures, notes, True) is None
    assert kernels.measure("fwd official", lambda: right * 1.1, ref, (0,), timer, 1, failures, notes, False) is None

    def raising():
        raise RuntimeError("Unsupported data type")

    assert kernels.measure("bwd official", raising, ref, (1, 2), timer, 1, failures, notes, False) is None
    assert len(failures) == 1 and failures[0].startswith("fwd ours: output off by"), failures
    assert [n.split(":")[0] for n in notes] == ["fwd official", "bwd official raised RuntimeError"], notes


def test_speed_goals_are_judged_not_failed():
    def row(name, pass_, ms, gbs=None, dtype="bfloat16"):
        return dict(dtype=dtype, case="uniform", name=name, pass_=pass_, ms=ms, gbs=gbs)

    rows = [row("segments", "fwd", 1.5, 2900.0), row("official", "fwd", 1.4, 3100.0), row("segments", "fwd+bwd", 5.0),
            row("official", "fwd+bwd", 9.0), row("segments", "fwd", 1.0, 9000.0, dtype="float32")]
    goals = speed_kernels.kernel_goals(rows, None, "NVIDIA H200")
    assert goals["forward >= 3.0 TB/s"].startswith("not met (2900")  # the bf16 row, not the fp32 one
    assert goals["fwd+bwd <= 6 ms"].startswith("met") and goals["fwd+bwd vs official"].startswith("met (1.80x)")
    assert goals["fwd vs official"].startswith("not met")
    # Not an H200: the bar is 85% of this run's copy bandwidth.
    h100 = speed_kernels.kernel_goals(rows, {"gbs": 3400.0}, "NVIDIA H100 80GB HBM3")
    assert h100 == {**{k: v for k, v in goals.items() if not k.startswith("forward >=")},
                    "forward >= 85% of the copy (3400 GB/s)": "met (2900 GB/s)"}


class _Event:
    """A profiler FunctionEvent's fields that bench/speed_profile.py reads."""

    def __init__(self, name, ms, parent=None, device=False, shapes=()):
        from torch.autograd import DeviceType

        self.name, self.cpu_parent, self.is_async = name, parent, False
        self.device_type = DeviceType.CUDA if device else DeviceType.CPU
        self.self_device_time_total = ms * 1e3  # microseconds, as the profiler gives them
        self.self_cpu_time_total = 0.0
        self.input_shapes = [list(s) for s in shapes]


def _step_events():
    """A Memory+ step as the profiler lists it: CPU ops (self device time = the
    kernels each launched itself) and the same kernels again as device events,
    plus one kernel no op claims. Times are binary fractions: sums are exact."""
    table = (64, 8)
    E = _Event
    step = E("ProfilerStep", 0.0)
    search = E("memlm::product_key_search", 1.0, step)
    inner = E("memlm::exact_subkey_scores", 0.5, search)            # nested: the search's part, once
    read = E("memlm::embedding_bag_into", 2.0, step)
    node = E("autograd::engine::evaluate_function: GeneratedBackwardFor_memlm_embedding_bag_into_defaultBackward",
             0.0, step)
    accumulate = E("memlm::embedding_bag_accumulate_", 3.0, node)
    autograd_sum = E("aten::add_", 4.0, node, shapes=[table, table])  # a table-sized add outside the read op
    mm_node = E("autograd::engine::evaluate_function: GeneratedBackwardFor_memlm_exact_linear_defaultBackward",
                0.0, step)
    mm = E("aten::mm", 0.25, mm_node, shapes=[(4, 8), (8, 8)])
    optim = E("Optimizer.step#TableAdamW.step", 0.0)
    norm = E("aten::_foreach_norm", 0.75, optim)                        # the clip's norm inside the step
    adamw = E("memlm::table_adamw_", 6.0, optim, shapes=[table])
    attention = E("aten::_flash_attention_forward", 8.0, step)
    cpu_ops = [step, search, inner, read, node, accumulate, autograd_sum, mm_node, mm, optim, norm, adamw, attention]
    kernels = [E(f"kernel {e.name}", e.self_device_time_total / 1e3, device=True)
               for e in cpu_ops if e.self_device_time_total]
    return cpu_ops + kernels + [E("an unlinked memset", 0.5, device=True)], {table}


def test_profile_counts_each_device_op_once_and_shares_sum_to_100_percent():
    events, tables = _step_events()
    parts, ops = speed_profile.split_device_time(events, tables)
    assert parts["total"] == 26.0  # the device events' durations: 25.5 launched by ops + 0.5 unlinked
    assert parts == {"search forward": 1.5, "search backward": 0.0, "read forward": 2.0, "read backward": 3.0,
                     "exact fp32 projections": 0.25, "table gradient sum / zeroing": 4.0, "clipping / norm": 0.75,
                     "optimizer step": 6.0, "the rest": 8.5, "total": 26.0}
    shares = speed_profile.shares(parts)
    assert sum(shares.values()) == 1.0 and set(shares) == set(parts) - {"total"}
    assert ops["aten::add_ [table gradient sum / zeroing]"] == {"op": "aten::add_",
                                                                "part": "table gradient sum / zeroing",
                                                                "ms": 4.0, "calls": 1}
    # Summing every event's self device time (kernels and the ops that launched them) counts each kernel twice.
    assert sum(e.self_device_time_total for e in events) / 1e3 == 2 * 25.5 + 0.5


def test_profile_of_a_dense_model_has_no_table_parts():
    events, _ = _step_events()
    parts, _ = speed_profile.split_device_time(events, set())
    # No table: the add_ goes with the backward node it ran under.
    assert parts["table gradient sum / zeroing"] == 0.0 and parts["read backward"] == 7.0 and parts["the rest"] == 8.5


def test_profile_kernel_table_sums_device_events():
    events, _ = _step_events()
    table = speed_profile.kernel_table(events)
    assert table[0] == {"kernel": "kernel aten::_flash_attention_forward", "ms": 8.0, "calls": 1}
    assert sum(r["ms"] for r in table) == 26.0


def test_sweep_reaches_maxnreg_and_one_warp_backward_and_no_duplicate_stages():
    from memlm.memory.fast import triton_bag

    base = triton_bag.Launch(1, 8, 1024, 4, 1)
    forward = launch_sweep.candidates(base, launch_sweep.FORWARD_SWEEP)
    backward = launch_sweep.candidates(triton_bag.Launch(8, 4, 1024, 8, 1), launch_sweep.SEGMENTS_SWEEP)
    for launches in (forward, backward):
        assert len(set(launches)) == len(launches)
        assert {la.num_stages for la in launches} == {1}  # stages 2 and 3 compiled to stage 1's code
        assert any(la.maxnreg for la in launches) and launches[0] in (base, backward[0])
    assert any(la.num_warps == 1 for la in backward)


def test_sweep_times_no_candidate_compiling_to_earlier_code():
    """Two launches whose compiled code hashes alike: the second is recorded, not timed."""
    from memlm.memory.fast import triton_bag

    class Compiled:
        def __init__(self, code):
            self.asm = {"cubin": code}

    class Jit:  # Triton's JITFunction cache: device -> (kernel cache, ...)
        device_caches = {0: ({}, None)}

    launches = [triton_bag.Launch(1, 8, 64, 4, 1), triton_bag.Launch(1, 8, 64, 4, 1, 255),
                triton_bag.Launch(1, 16, 64, 4, 1)]
    code = {launches[0]: b"A", launches[1]: b"A", launches[2]: b"B"}
    timed = []

    def call(launch):
        Jit.device_caches[0][0][launch] = Compiled(code[launch])
        return torch.zeros(1)

    def measure(label, fn, *args):
        timed.append(label)
        return 1e-3

    recorded = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch_sweep, "measure", measure)
        rows = launch_sweep._run_candidates("forward", launches, call, Jit, None, (0,), None, 1, [], torch.float32,
                                            0, recorded.append)
    assert [r.get("same_code_as") for r in rows] == [None, list(launches[0]), None]
    assert len(timed) == 2 and recorded[-1] == rows


def test_best_launches_become_the_runs_config_values(tmp_path):
    """The sweep's fastest timed launch of each pass, as the memory.triton_* overrides
    the training parts compose (so each run's config.yaml records them)."""
    from memlm.config.run import compose
    from memlm.memory.fast import launches

    sweep = {"dtype": "float32", "elem_bytes": 4,
             "forward": [dict(launch=[1, 4, 1024, 8, 1, None], ms=2.0), dict(launch=[1, 16, 1024, 4, 1, 255], ms=1.5),
                         dict(launch=[1, 16, 1024, 4, 1, 128], same_code_as=[1, 16, 1024, 4, 1, 255])],
             "segments": [dict(launch=[8, 4, 1024, 1, 1, None, True], ms=3.0)]}
    overrides = launch_sweep.config_overrides(sweep)
    assert overrides == ["memory.triton_forward=[1,16,4,1,255,0]", "memory.triton_backward=[8,4,1,1,0,1]"]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"sweeps": {"float32": sweep}}))
    assert gpu_speed.sweep_launches(path, "float32") == overrides
    assert gpu_speed.sweep_launches(path, "bfloat16") == gpu_speed.sweep_launches(path, None) == []
    cfg = compose(["memory=memplus", "memory.layers=[1]", *overrides])
    assert (cfg.memory.triton_forward, cfg.memory.triton_backward) == ([1, 16, 4, 1, 255, 0], [8, 4, 1, 1, 0, 1])
    assert launches.launch_problem(cfg.memory.triton_forward) is None


def test_recorder_writes_the_json_after_every_row(tmp_path):
    path = tmp_path / "part.json"
    record = gpu_speed.Recorder(path, {"part": "kernels"})
    record("rows", {"ms": 1.0})
    assert json.loads(path.read_text()) == {"part": "kernels", "rows": [{"ms": 1.0}]}
    record("rows", {"ms": 2.0})
    record("copy", {"gbs": 3.0})
    assert json.loads(path.read_text()) == {"part": "kernels", "rows": [{"ms": 1.0}, {"ms": 2.0}],
                                            "copy": {"gbs": 3.0}}


def test_speed_parts_replace_only_their_own_part(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    gpu_speed.write_part(doc, "Profile", "profile one")
    gpu_speed.write_part(doc, "Kernels", "kernels one")
    gpu_speed.write_part(doc, "Profile", "profile two")
    text = doc.read_text()
    assert "## Other\n\nkept" in text and "profile one" not in text
    assert text.index("### Kernels\n\nkernels one") < text.index("### Profile\n\nprofile two")


def test_speed_without_a_gpu_fails_unless_dry(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_speed.main(["profile"]) == 1
    assert "RESULT speed_profile FAIL: no CUDA device" in capsys.readouterr().out


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
    result = device_train.watch_fit(_small_trainer(tmp_path), cuda=False)
    # Steps 1-3 are watched (step 4 logs); each reads once.
    assert result["n_syncs"] == 3 and result["steps"] == 4, result
    assert result["syncs"][0].startswith("step 1: item at ") and "(with_item)" in result["syncs"][0]


def test_nosync_passes_a_clean_run_and_watches_only_non_logging_steps(tmp_path):
    trainer = _small_trainer(tmp_path, *device_train.TINY_MOE)
    assert device_train.watch_fit(trainer, cuda=False) == {"steps": 4, "syncs": [], "n_syncs": 0}


def test_host_read_counter_on_a_gpu_counts_only_cuda_tensors():
    with device_train.HostReadCounter(cuda=True) as reads:
        reads.armed = True
        torch.ones(2).sum().item()  # a CPU tensor: no device sync
        reads.armed = False
    assert reads.reads == []
    with device_train.HostReadCounter(cuda=False) as reads:
        reads.armed = True
        torch.ones(2).sum().item()
        bool(torch.ones(()))
        reads.armed = False
    assert [r.split(" at ")[0] for _, r in reads.reads] == ["item", "__bool__"]
    assert torch.Tensor.item is not reads._counted  # restored
