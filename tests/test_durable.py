"""The one atomic write every writer of a whole file uses (dflash_core/files/durable.py)."""
import os
import stat

import pytest

from dflash_core.files.durable import atomic_file, temporary_sibling, write_atomic


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "pointer"
    write_atomic(path, "step_00000010")
    write_atomic(path, b"step_00000020")
    assert path.read_text() == "step_00000020"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pointer"]


def test_a_write_failing_midway_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "records.jsonl"
    write_atomic(path, "old, whole\n")
    with pytest.raises(OSError, match="No space left"):
        with atomic_file(path, "w", encoding="utf-8") as file:
            file.write("new, half")
            file.flush()
            assert temporary_sibling(path).read_text() == "new, half"   # written beside it, not into it
            raise OSError(28, "No space left on device")
    assert path.read_text() == "old, whole\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records.jsonl"]


def test_the_temporary_sits_beside_the_path_and_names_its_writer(tmp_path):
    assert temporary_sibling(tmp_path / "latest") == tmp_path / f".latest.{os.getpid()}.tmp"


def test_permissions_are_set_whatever_the_umask(tmp_path):
    path = tmp_path / "README.md"
    previous = os.umask(0o077)
    try:
        write_atomic(path, "a card other users serve", permissions=0o644)
        write_atomic(tmp_path / "private", "umask decides")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600


def test_only_whole_file_modes_are_accepted(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb', not 'a'"):
        with atomic_file(tmp_path / "log", "a"):
            pass
