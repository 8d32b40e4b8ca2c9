"""memlm.files: atomic writes replace the target whole or leave it untouched."""

from __future__ import annotations

import json

import pytest

from memlm.files import atomic_output, atomic_write_bytes, atomic_write_json, atomic_write_text


def test_writes_replace_the_target_and_leave_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    atomic_write_json(target, {"b": 1, "a": [1.5]}, indent=1, sort_keys=True)
    assert target.read_text() == json.dumps({"a": [1.5], "b": 1}, indent=1, sort_keys=True) + "\n"
    atomic_write_text(tmp_path / "t.txt", "héllo\n")
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo\n"
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01", durable=False)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "out.json", "t.txt"]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_json(target, {"x": object()})
    with pytest.raises(RuntimeError, match="tool failed"):
        with atomic_output(target, suffix=".npy") as tmp:
            assert tmp.name.endswith(".npy") and tmp.parent == tmp_path
            tmp.write_text("half")
            raise RuntimeError("tool failed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_atomic_output_takes_the_file_a_tool_wrote(tmp_path):
    import numpy as np

    target = tmp_path / "idx.npy"
    with atomic_output(target, suffix=".npy") as tmp:
        np.save(tmp, np.arange(3))
    assert np.load(target).tolist() == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["idx.npy"]
