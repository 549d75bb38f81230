import os

import torch

from launcher.run_io import checkpoint


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
    torn = tmp_path / f".tmp_step_00000020_{os.getpid() + 1}"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"\x80partial")
    assert checkpoint.load_latest(tmp_path)[1] == 10


def test_corrupt_checkpoint_is_skipped_with_warning(tmp_path, caplog):
    checkpoint.save(tmp_path, 10, _state(10), keep=3)
    bad = checkpoint.save(tmp_path, 20, _state(20), keep=3)
    (bad / "state.pt").write_bytes(b"garbage")
    with caplog.at_level("WARNING", logger="dflash"):
        _, step, _ = checkpoint.load_latest(tmp_path)
    assert step == 10
    assert "step_00000020" in caplog.text and "unreadable" in caplog.text


def test_no_checkpoint(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None
