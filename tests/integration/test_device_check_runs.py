"""bench/device_check.sh end to end on CPU (DRY_RUN=1): a failure patched into
each section's process makes that section FAIL with its reason and the run
exit non-zero; with nothing patched, the dry run of the training sections
passes. The in-process checks of the same sections: test_device_check.py and
test_device_check_gpu_speed.py.

A failure is patched in through a sitecustomize.py on PYTHONPATH, which Python
imports at start-up in every section's process.

    python -m pytest -q tests/integration/test_device_check_runs.py -m slow
"""

from __future__ import annotations

import sys
import textwrap

import pytest
from device_check_run import run_device_check, summary_line

# A graph break in every call of cls.forward, the blocks compiled with aot_eager (CPU, no inductor).
GRAPH_BREAK = """
    import torch
    import memlm.distributed.parallelize as parallelize
    from {module} import {cls}
    def apply_compile(model):
        for block in model.layers:
            block.compile(backend="aot_eager")
    parallelize.apply_compile = apply_compile
    forward = {cls}.forward
    def with_break(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)
    {cls}.forward = with_break
"""
# sitecustomize.py sources that patch a failure into a section's process.
INJECT = {
    "kernel_tests": """
        import memlm.memory.fast.ops as ops
        def broken(*args, **kwargs):
            raise RuntimeError("injected kernel error")
        ops.embedding_bag = broken
    """,
    "kernel_bench": """
        import memlm.memory.fast.ops as ops
        right = ops.embedding_bag
        ops.embedding_bag = lambda *a, **k: right(*a, **k) * 1.5
    """,
    "mfu": """
        import memlm.train.metrics as metrics
        metrics.device_peak_flops = lambda device: 989e12  # an H200's peak for the CPU
    """,
    "nosync": """
        from memlm.train.trainer import Trainer
        forward_loss = Trainer._forward_loss
        def with_item(self, *args, **kwargs):
            loss = forward_loss(self, *args, **kwargs)
            loss.item()
            return loss
        Trainer._forward_loss = with_item
    """,
    "compile_dense": GRAPH_BREAK.format(module="memlm.model.block", cls="Block"),
    "compile_memplus": GRAPH_BREAK.format(module="memlm.memory", cls="MemoryPlus"),
    "paths": """
        from memlm.train.trainer import Trainer
        init = Trainer.__init__
        def broken(self, cfg, *args, **kwargs):  # a crash of one CUDA-only branch
            if cfg.memory.kernel == "torch":
                raise RuntimeError("element 0 of tensors does not require grad")
            init(self, cfg, *args, **kwargs)
        Trainer.__init__ = broken
    """,
    "equivalence": """
        from memlm.train.trainer import Trainer
        train_step = Trainer.train_step
        def off(self, *args, **kwargs):  # the 1-process reference only (the ranks are spawned processes)
            metrics = train_step(self, *args, **kwargs)
            return {**metrics, "loss": metrics["loss"] * 1.01} if metrics else metrics
        Trainer.train_step = off
    """,
}
WHY = {"kernel_tests": "failed: tests.unit.test_kernels_ops::",  # every test that reads fails
       "kernel_bench": "output off by",
       "mfu": "under the floor 10%", "nosync": "item at", "compile_dense": "graph break(s), expected 0",
       "compile_memplus": "graph break(s), expected 0",
       "paths": "1 of 8 paths failed: kernel_torch: RuntimeError: element 0",
       "equivalence": "2 ranks differ from 1 process"}


@pytest.mark.slow
@pytest.mark.parametrize("section", sorted(INJECT))
def test_an_injected_failure_fails_the_section_and_the_run(tmp_path, section):
    site = tmp_path / "site"
    site.mkdir()
    only = "" if section.startswith("kernel") else "device_train.py"
    body = textwrap.indent(textwrap.dedent(INJECT[section]), "    ")
    (site / "sitecustomize.py").write_text(f"import sys\nif {only!r} in (sys.argv[0] if sys.argv else ''):\n{body}")
    result = run_device_check(tmp_path, PYTHON=sys.executable, SECTIONS=section, DRY_RUN="1", PYTHONPATH=str(site))
    line = summary_line(tmp_path, section)
    assert result.returncode != 0, line
    assert "FAIL" in line and WHY[section] in line, line
    assert "failed sections: 1" in result.stdout


@pytest.mark.slow
def test_dry_run_passes(tmp_path):
    # compile_memplus is left out here only for time (about 2 minutes of CPU
    # compilation); compile_dense runs the same code.
    sections = "env kernel_tests kernel_bench mfu nosync compile_dense paths equivalence"
    result = run_device_check(tmp_path, PYTHON=sys.executable, SECTIONS=sections, DRY_RUN="1")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == 0, summary + result.stdout[-3000:]
    for section in sections.split():
        assert " ok " in summary_line(tmp_path, section), summary
    assert "RESULT mfu ok" in summary and "RESULT equivalence ok" in summary
    assert (tmp_path / "out" / "mfu.json").exists()
