"""memlm.files.atomic_output_dir: a folder is replaced whole or left as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import memlm.files as files
from memlm.files import atomic_output_dir


def _folder(path, **contents):
    path.mkdir(parents=True)
    for name, text in contents.items():
        (path / name).write_text(text)
    return path


def test_the_new_folder_replaces_the_old_and_nothing_is_left_beside_it(tmp_path):
    out = _folder(tmp_path / "out", a="old", stale="old")
    with atomic_output_dir(out) as new:
        assert new.parent == tmp_path and new.name.startswith(".out.new") and not list(new.iterdir())
        (new / "a").write_text("new")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with atomic_output_dir(tmp_path / "deeper" / "fresh") as new:  # parents made, nothing to replace
        (new / "b").write_text("b")
    assert (tmp_path / "deeper" / "fresh" / "b").read_text() == "b"


def test_an_error_while_writing_leaves_the_old_folder(tmp_path):
    out = _folder(tmp_path / "out", a="old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_output_dir(out) as new:
            (new / "a").write_text("half")
            raise RuntimeError("writer failed")
    assert (out / "a").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = _folder(tmp_path / "out", a="old")
    rename = os.rename

    def second_rename_fails(src, dst):
        if ".new" in str(src):
            raise OSError("rename failed")
        rename(src, dst)

    monkeypatch.setattr(files.os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="rename failed"):
        with atomic_output_dir(out) as new:
            (new / "a").write_text("new")
    assert (out / "a").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_leftovers_of_a_dead_writer_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    _folder(tmp_path / f".out.new{dead}.0123abcd", a="half")
    (tmp_path / f".out.old{dead}.89abcdef").write_text("old copy")
    live = _folder(tmp_path / f".out.new{os.getppid()}.0123abcd", a="writing")
    other = _folder(tmp_path / f".other.new{dead}.0123abcd", a="not ours")
    with atomic_output_dir(tmp_path / "out") as new:
        (new / "a").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, other.name])
