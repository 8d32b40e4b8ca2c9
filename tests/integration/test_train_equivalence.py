"""Distributed training equals one process on the concatenated global batch.

The test that proves FSDP2 and the memory-parallel sharding of the value
table, including the gradient scaling of both."""

from __future__ import annotations

import pytest
from equivalence import BASE, MEMPLUS, assert_same, distributed_run, global_batches, reference_run


@pytest.mark.slow
def test_dense_two_ranks_equal_one_process(tmp_path):
    batches = global_batches(128)
    ref = reference_run(BASE, batches, tmp_path / "ref")
    got = distributed_run(BASE, batches, tmp_path)
    assert_same(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("memory_parallel", [1, 2])
def test_memplus_two_ranks_equal_one_process(tmp_path, memory_parallel):
    batches = global_batches(128)
    ref = reference_run(MEMPLUS, batches, tmp_path / "ref")
    got = distributed_run([*MEMPLUS, f"parallel.memory_parallel={memory_parallel}"], batches, tmp_path)
    assert_same(ref, got)
    assert "shared.memory_values.weight" in got["state"]
