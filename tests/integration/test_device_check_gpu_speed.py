"""The speed section of bench/device_check.sh (bench/gpu_speed.py and its parts: speed_kernels,
speed_profile, launch_sweep), its functions called in this process with the failure patched in: ours
failing and the official kernels noted, the goals judged, the profile's shares, the launch sweep's
candidates, the recorder. The rest of the script's checks: tests/integration/test_device_check.py."""

from __future__ import annotations

import json

import pytest
import torch
from device_check_run import load_bench

kernels = load_bench("kernels")
gpu_speed = load_bench("gpu_speed")
speed_kernels = load_bench("speed_kernels")
speed_profile = load_bench("speed_profile")
launch_sweep = load_bench("launch_sweep")


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
