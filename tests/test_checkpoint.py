import errno
import os
import signal
import subprocess
import sys

import pytest
import torch

from dflash_core.files.readers import UnsafeFileError
from launcher.export import export_checkpoint
from launcher.run_io import checkpoint
from tests.launching import REPO

# A writer that stops for good in the middle of writing state.pt (as a large save on a slow disk does).
_WRITER_STUCK_MID_WRITE = """
import sys, time, torch
from launcher.run_io import checkpoint
def half_written(state, f):
    f.write(b"PK\\x03\\x04 the first bytes")
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
torch.save = half_written
checkpoint.save(sys.argv[1], 20, {"step": 20}, keep=2)
"""


def _state(step):
    return {"step": step, "model": {"w": torch.full((3,), float(step))}}


def test_latest_complete_checkpoint_and_pruning(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, _state(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_00000020",
                                                                                         "step_00000030"]
    assert (tmp_path / "latest").read_text() == "step_00000030"
    path, step, state = checkpoint.load_latest(tmp_path)
    assert path.name == "step_00000030" and step == 30 and torch.equal(state["model"]["w"], torch.full((3,), 30.0))


def test_crash_mid_write_leaves_previous_loadable(tmp_path):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    # A writer killed before its rename leaves only a temporary dir behind.
    torn = tmp_path / f".step_00000020.{os.getpid() + 1}.tmp"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"\x80partial")
    assert checkpoint.load_latest(tmp_path)[1] == 10


def test_a_dead_writers_temporaries_are_removed_under_either_naming(tmp_path):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    dead = os.getpid() + 1
    # This version's names, and those of the version before (a run dir it wrote may still hold them).
    left = [tmp_path / f".step_00000020.{dead}.tmp", tmp_path / f".tmp_step_00000020_{dead}"]
    for directory in left:
        directory.mkdir()
    (tmp_path / f".latest_{dead}").write_text("step_00000020")
    checkpoint.save(tmp_path, 20, _state(20), keep=3)
    assert not any(path.exists() for path in [*left, tmp_path / f".latest_{dead}"])
    assert checkpoint.load_latest(tmp_path)[1] == 20


def test_corrupt_checkpoint_is_skipped_with_warning(tmp_path, caplog):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    bad = checkpoint.save(tmp_path, 20, _state(20), keep=3)
    (bad / "state.pt").write_bytes(b"garbage")
    with caplog.at_level("WARNING", logger="dflash"):
        _, step, _ = checkpoint.load_latest(tmp_path)
    assert step == 10
    assert "step_00000020" in caplog.text and "unreadable" in caplog.text


class _Payload:
    """What a planted state file carries: unpickling it runs a shell command that leaves `marker`."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_state_file_carrying_code_is_refused_named_and_never_run(tmp_path):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    planted = checkpoint.save(tmp_path, 20, {"step": 20, "model": {"w": _Payload(tmp_path / "ran")}}, keep=3)
    live = tmp_path / "live.pt"   # the same payload, opened the old way, does run: the test plants a live one
    torch.save(_Payload(tmp_path / "ran-unsafely"), live)
    torch.load(live, weights_only=False)
    assert (tmp_path / "ran-unsafely").exists()

    said = (rf"{planted / 'state.pt'}: refused: it holds code or objects a checkpoint must not hold \(its pickle "
            rf"asks for (posix|os|nt)\.system\); it was not loaded and nothing in it ran")
    with pytest.raises(UnsafeFileError, match=said):
        checkpoint.load(planted)
    with pytest.raises(UnsafeFileError, match=said):   # not passed over for the previous one: the user decides
        checkpoint.load_latest(tmp_path)
    with pytest.raises(UnsafeFileError, match=said):
        export_checkpoint(planted, tmp_path / "export")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "export").exists()


def test_no_checkpoint(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_latest_and_pruning_follow_this_lineage_not_the_name_order(tmp_path):
    # The scenario: an older run left step_00000080 and step_00000100; a new training history
    # in the same dir then saves step_00000010. A name sort used to prune the new run's checkpoint at
    # once, leave `latest` dangling, and "resume" the old run's step 100 (training 0 steps).
    for step in (80, 100):
        checkpoint.save(tmp_path, step, _state(step), keep=2)
    old_lineage = checkpoint.read_lineage(tmp_path)["id"]
    new_lineage = checkpoint.start_lineage(tmp_path)
    checkpoint.save(tmp_path, 10, _state(10), keep=2)
    assert (tmp_path / "latest").read_text() == "step_00000010" and (tmp_path / "step_00000010").is_dir()
    path, step, _ = checkpoint.load_latest(tmp_path)
    assert (path.name, step) == ("step_00000010", 10)
    for step in (20, 30):
        checkpoint.save(tmp_path, step, _state(step), keep=2)
    # Only this lineage's oldest went; the other history's checkpoints are not this run's to prune.
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_00000020", "step_00000030", "step_00000080",
                                                               "step_00000100"]
    assert checkpoint.read_meta(tmp_path / "step_00000030")["lineage"] == new_lineage != old_lineage
    assert checkpoint.load_latest(tmp_path)[1] == 30


def test_latest_is_never_pruned_and_a_missing_one_falls_back(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, _state(step), keep=1)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_00000003"]
    checkpoint.save(tmp_path, 4, _state(4), keep=2)
    # Someone deletes the checkpoint `latest` names: the previous one of the lineage is used, no dangling read.
    (tmp_path / "step_00000004" / "meta.json").unlink()
    assert checkpoint.pointed(tmp_path) is None
    assert checkpoint.load_latest(tmp_path)[1] == 3


def test_a_checkpoint_of_another_lineage_is_never_overwritten(tmp_path):
    checkpoint.save(tmp_path, 5, _state(5), keep=2)
    checkpoint.start_lineage(tmp_path)
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"step_00000005 belongs to another run"):
        checkpoint.save(tmp_path, 5, _state(5), keep=2)
    assert checkpoint.load(tmp_path / "step_00000005")[0] == 5


def test_disk_full_leaves_no_temporary_dir_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 10, _state(10), keep=2)

    def full_disk(state, f):
        f.write(b"PK\x03\x04 the first bytes")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError) as failure:
        checkpoint.save(tmp_path, 20, _state(20), keep=2)
    message = str(failure.value)
    assert str(tmp_path / "step_00000020") in message and "No space left on device (ENOSPC)" in message
    assert "latest still names step_00000010" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage.json", "step_00000010"]
    assert checkpoint.load_latest(tmp_path)[1] == 10


def test_a_writer_killed_mid_write_leaves_nothing_after_the_next_save(tmp_path, caplog):
    checkpoint.save(tmp_path, 10, _state(10), keep=5)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER_STUCK_MID_WRITE, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    left = tmp_path / f".step_00000020.{writer.pid}.tmp"
    assert (left / "state.pt").is_file()   # what the dead writer left: the previous checkpoint still loads
    assert checkpoint.load_latest(tmp_path)[1] == 10
    with caplog.at_level("WARNING", logger="dflash"):
        checkpoint.save(tmp_path, 30, _state(30), keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage.json", "step_00000010", "step_00000030"]
    assert f"removing {left}: a checkpoint writer (pid {writer.pid}) died while writing it" in caplog.text


def test_a_dead_writers_pointer_and_lineage_temporaries_go_too(tmp_path):
    checkpoint.save(tmp_path, 10, _state(10), keep=5)
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (f".latest.{dead.pid}.tmp", f".lineage.json.{dead.pid}.tmp"):
        (tmp_path / name).write_text("step_000")
    unrelated = tmp_path / "notes.txt"   # not a writer's temporary: never touched
    unrelated.write_text("mine")
    checkpoint.save(tmp_path, 20, _state(20), keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage.json", "notes.txt", "step_00000010",
                                                          "step_00000020"]
