"""Profiler trace and CUDA memory snapshot of chosen training steps: `profile.steps=[a,b]`.

    profiler = StepProfiler(cfg.profile.steps, dump_dir, device, rank)   # on the loop (train/extensions.py)
    profiler.step_start(step)        # starts recording when step == a (or later, after a resume inside [a, b])
    trainer.train_step()
    profiler.step_end(step)          # stops and writes after step b
    profiler.close()                 # in a finally: a run that ends inside [a, b] writes what it recorded

Each rank writes into dump_dir/profile/:
- `trace_rank{r}_steps{a}-{b}.json`: torch.profiler's Chrome trace (CPU, and CUDA
  kernels on GPU; shapes and memory events); open it in https://ui.perfetto.dev
  or chrome://tracing.
- on CUDA, `memory_rank{r}_steps{a}-{b}.pickle`: the allocator history of those
  steps (`torch.cuda.memory._dump_snapshot`; torch's own pickle format, the one
  https://pytorch.org/memory_viz reads: the one pickle memlm writes, and only on request).

Steps are numbered as in the logs (the first step is 1); profiled steps run
slower (recording, and the host waits for the trace to be written).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept for the snapshot (torch's own default)


class StepProfiler:
    def __init__(self, steps: list[int], dump_dir: Path, device: torch.device, rank: int = 0):
        self.first, self.last = (steps[0], steps[1]) if steps else (1, 0)  # [] -> an empty range: off
        self.out = Path(dump_dir) / "profile"
        self.cuda = device.type == "cuda"
        self.rank = rank
        self._prof: profile | None = None
        self._range: record_function | None = None  # the running step's span in the trace
        self._start = 0
        self._steps_run = 0  # the last step run while recording
        self.written: list[Path] = []

    def step_start(self, step: int) -> None:
        """`step` (1-based) is about to run."""
        if self._prof is None and not self.written and self.first <= step <= self.last:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
            self._prof.start()
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._start, self._steps_run = step, step - 1
        if self._prof is not None:
            self._range = record_function(f"train_step {step}")
            self._range.__enter__()

    def step_end(self, step: int, run: object = None) -> None:
        """`step` (1-based) has run."""
        if self._prof is None:
            return
        self._end_range()
        self._steps_run = step
        if step >= self.last:
            self._write()

    def close(self) -> None:
        if self._prof is not None:
            self._write()

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _write(self) -> None:
        self._end_range()  # a step that raised
        prof, self._prof = self._prof, None
        prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self._start}-{self._steps_run}"
        self.written.append(_atomic(self.out / f"trace_{name}.json", prof.export_chrome_trace))
        if self.cuda:
            self.written.append(_atomic(self.out / f"memory_{name}.pickle", torch.cuda.memory._dump_snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            print(f"[train] profile of steps {self._start}-{self._steps_run} (each rank writes its own): "
                  + ", ".join(str(p) for p in self.written), flush=True)


def _atomic(path: Path, write) -> Path:
    """write(tmp name), then rename: a killed run leaves no half-written file under the final name."""
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)
    return path
