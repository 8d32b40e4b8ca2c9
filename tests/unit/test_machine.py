"""What a record names of its machine and code (memlm.machine), and when two promise equal runs."""

from __future__ import annotations

import torch

from memlm.machine import run_environment, same_environment

ENV = {"commit": "abc", "dirty": False, "torch": "2.13.0+cpu", "cpu": "AMD EPYC", "cpu_capability": "AVX2"}


def test_the_environment_names_the_vector_unit_torch_uses():
    env = run_environment()
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {"commit", "dirty", "torch", "python", "cpu", "cores"} < env.keys()


def test_equal_runs_are_promised_only_by_the_same_clean_commit_torch_cpu_and_vector_unit():
    assert same_environment(ENV, dict(ENV))
    # One CPU model name covers machines whose torch kernels differ (AVX2 and AVX512 "AMD EPYC").
    assert not same_environment(ENV, {**ENV, "cpu_capability": "AVX512"})
    old = {k: v for k, v in ENV.items() if k != "cpu_capability"}  # a record from before the field
    assert not same_environment(old, ENV) and not same_environment(ENV, old) and not same_environment(old, old)
    assert not same_environment(ENV, {**ENV, "dirty": True})
    assert not same_environment(ENV, {**ENV, "torch": "2.12.0"})
    assert not same_environment(None, ENV)
