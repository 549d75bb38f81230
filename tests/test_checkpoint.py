import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from dflash_core.files.readers import BadFileError, UnsafeFileError, read_dcp_metadata
from launcher.export import export_checkpoint
from launcher.run_io import checkpoint
from launcher.run_io.checkpoint import Piece
from tests.launching import REPO

# A writer that stops for good in the middle of writing its shard (as a large save on a slow disk does).
_WRITER_STUCK_MID_WRITE = """
import sys, time, torch
from launcher.run_io import checkpoint
def half_written(state, f):
    f.write(b"PK\\x03\\x04 the first bytes")
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
torch.save = half_written
checkpoint.save(sys.argv[1], 20, [checkpoint.Piece.whole("model.w", torch.zeros(3))], {"step": 20}, keep=2)
"""


def _save(root, step, keep, value=None):
    """A checkpoint of one weight `w` (filled with `step`), written by this process alone."""
    weight = torch.full((3,), float(step)) if value is None else value
    return checkpoint.save(root, step, [Piece.whole("model.w", weight)],
                           {"step": step, "drafter_config": {}, "shapes": {"w": [3]}}, keep)


def test_latest_complete_checkpoint_and_pruning(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_00000020",
                                                                                         "step_00000030"]
    assert (tmp_path / "latest").read_text() == "step_00000030"
    path, step = checkpoint.load_latest(tmp_path)
    assert path.name == "step_00000030" and step == 30
    assert torch.equal(checkpoint.load_weights(path)[2]["w"], torch.full((3,), 30.0))
    # One process wrote it: one shard, DCP's metadata, the trainer's state and meta.json, written last.
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "meta.json", "trainer.json"]


def test_crash_mid_write_leaves_previous_loadable(tmp_path):
    _save(tmp_path, 10, keep=3)
    # A writer killed before its rename leaves only a temporary dir behind.
    torn = tmp_path / f".step_00000020.{os.getpid() + 1}.tmp"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"\x80partial")
    assert checkpoint.load_latest(tmp_path)[1] == 10


def test_a_dead_writers_temporaries_are_removed_under_either_naming(tmp_path):
    _save(tmp_path, 10, keep=3)
    dead = os.getpid() + 1
    # This version's names, and those of the version before (a run dir it wrote may still hold them).
    left = [tmp_path / f".step_00000020.{dead}.tmp", tmp_path / f".tmp_step_00000020_{dead}"]
    for directory in left:
        directory.mkdir()
    (tmp_path / f".latest_{dead}").write_text("step_00000020")
    _save(tmp_path, 20, keep=3)
    assert not any(path.exists() for path in [*left, tmp_path / f".latest_{dead}"])
    assert checkpoint.load_latest(tmp_path)[1] == 20


def test_a_cut_short_or_corrupt_checkpoint_is_skipped_with_warning(tmp_path, caplog):
    _save(tmp_path, 10, keep=3)
    bad = _save(tmp_path, 20, keep=3)
    shard = bad / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])   # an interrupted copy
    with pytest.raises(BadFileError, match=r"__0_0.distcp: cut short: its checkpoint's .metadata records [\d,]+ "
                                           r"bytes in it \(100 bytes"):
        checkpoint.verify(bad)
    with caplog.at_level("WARNING", logger="dflash"):
        assert checkpoint.load_latest(tmp_path)[1] == 10
    assert "step_00000020 is unreadable" in caplog.text
    (bad / ".metadata").write_bytes(b"garbage")
    with pytest.raises(BadFileError, match=r"\.metadata: not a readable DCP metadata file"):
        checkpoint.verify(bad)


class _Payload:
    """What a planted file carries: unpickling it runs a shell command that leaves `marker`."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _refused(path):
    return (rf"{path}: refused: it holds code or objects a checkpoint must not hold \(its pickle asks for "
            rf"(posix|os|nt)\.system\); it was not loaded and nothing in it ran")


def test_a_checkpoint_carrying_code_is_refused_named_and_never_run(tmp_path):
    _save(tmp_path, 10, keep=3)
    planted = _save(tmp_path, 20, keep=3)
    # DCP's .metadata is a plain pickle (torch's own reader opens it with pickle.load): planted there, the payload
    # would run on opening; ours knows only DCP's records.
    (planted / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "ran")))
    live = tmp_path / "live.pkl"   # the same payload, opened the plain way, does run: the test plants a live one
    live.write_bytes(pickle.dumps(_Payload(tmp_path / "ran-unsafely")))
    pickle.loads(live.read_bytes())
    assert (tmp_path / "ran-unsafely").exists()

    said = _refused(planted / ".metadata")
    with pytest.raises(UnsafeFileError, match=said):
        checkpoint.verify(planted)
    with pytest.raises(UnsafeFileError, match=said):   # not passed over for the previous one: the user decides
        checkpoint.load_latest(tmp_path)
    with pytest.raises(UnsafeFileError, match=said):
        export_checkpoint(planted, tmp_path / "export")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "export").exists()

    # A tensor file (torch.save of each chunk, read with weights_only) carrying it is refused as well, its
    # .metadata rewritten to match (a consistent plant, not a torn file).
    shards = _save(tmp_path / "again", 30, keep=1)
    torch.save(_Payload(tmp_path / "ran"), shards / "__0_0.distcp")
    metadata = read_dcp_metadata(shards / ".metadata")
    for info in metadata.storage_data.values():
        info.length = (shards / "__0_0.distcp").stat().st_size
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeFileError, match=_refused(shards)):
        checkpoint.load_weights(shards)
    assert not (tmp_path / "ran").exists()


def _legacy_checkpoint(path, step, payload=None):
    """A checkpoint as earlier versions wrote it: meta.json and one state.pt (the lead's gather)."""
    path.mkdir(parents=True)
    weights = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}
    moments = {i: {"step": torch.tensor(float(step)), "exp_avg": value * 0.1, "exp_avg_sq": value * 0.01}
               for i, value in enumerate(weights.values())}
    state = {"step": step, "model": weights if payload is None else {**weights, "w": payload},
             "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}]},
             "scheduler": {"last_epoch": step}, "rng": {"python": (3, tuple(range(625)), None),
                                                      "torch": torch.get_rng_state()},
             "drafter_config": {"block_size": 4}, "tokens_seen": 99}
    torch.save(state, path / "state.pt")
    (path / "meta.json").write_text(json.dumps({"step": step}))
    return weights


def test_a_checkpoint_of_earlier_versions_is_read_with_weights_only_and_said_so(tmp_path, caplog):
    weights = _legacy_checkpoint(tmp_path / "step_00000005", 5)
    assert checkpoint.load_latest(tmp_path) == (tmp_path / "step_00000005", 5)
    with caplog.at_level("WARNING", logger="dflash"):
        step, config, loaded = checkpoint.load_weights(tmp_path / "step_00000005")
    assert (step, config) == (5, {"block_size": 4})
    assert all(torch.equal(loaded[name], value) for name, value in weights.items())
    assert "single-file format of earlier versions (state.pt): read whole, with weights_only" in caplog.text
    # A rank's shard of the moments, as the trainer restores it at any drafter count.
    part = Piece("exp_avg_sq.w", 6, 2, torch.zeros(3))
    checkpoint.read_pieces(tmp_path / "step_00000005", [part])
    assert torch.equal(part.tensor, torch.arange(2.0, 5.0) * 0.01)
    state = checkpoint.read_state(tmp_path / "step_00000005")
    assert state["optimizer"] == {"step": 5.0, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}
    assert (state["tokens_seen"], state["shapes"]) == (99, {"w": [2, 3], "b": [2]})

    planted = tmp_path / "planted" / "step_00000005"
    _legacy_checkpoint(planted, 5, payload=_Payload(tmp_path / "ran"))
    with pytest.raises(UnsafeFileError, match=_refused(planted / "state.pt")):
        checkpoint.verify(planted)
    assert not (tmp_path / "ran").exists()


def test_no_checkpoint(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_latest_and_pruning_follow_this_lineage_not_the_name_order(tmp_path):
    # The scenario: an older run left step_00000080 and step_00000100; a new training history
    # in the same dir then saves step_00000010. A name sort used to prune the new run's checkpoint at
    # once, leave `latest` dangling, and "resume" the old run's step 100 (training 0 steps).
    for step in (80, 100):
        _save(tmp_path, step, keep=2)
    old_lineage = checkpoint.read_lineage(tmp_path)["id"]
    new_lineage = checkpoint.start_lineage(tmp_path)
    _save(tmp_path, 10, keep=2)
    assert (tmp_path / "latest").read_text() == "step_00000010" and (tmp_path / "step_00000010").is_dir()
    path, step = checkpoint.load_latest(tmp_path)
    assert (path.name, step) == ("step_00000010", 10)
    for step in (20, 30):
        _save(tmp_path, step, keep=2)
    # Only this lineage's oldest went; the other history's checkpoints are not this run's to prune.
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_00000020", "step_00000030", "step_00000080",
                                                               "step_00000100"]
    assert checkpoint.read_meta(tmp_path / "step_00000030")["lineage"] == new_lineage != old_lineage
    assert checkpoint.load_latest(tmp_path)[1] == 30


def test_latest_is_never_pruned_and_a_missing_one_falls_back(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=1)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step_00000003"]
    _save(tmp_path, 4, keep=2)
    # Someone deletes the checkpoint `latest` names: the previous one of the lineage is used, no dangling read.
    (tmp_path / "step_00000004" / "meta.json").unlink()
    assert checkpoint.pointed(tmp_path) is None
    assert checkpoint.load_latest(tmp_path)[1] == 3


def test_a_checkpoint_of_another_lineage_is_never_overwritten(tmp_path):
    _save(tmp_path, 5, keep=2)
    checkpoint.start_lineage(tmp_path)
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"step_00000005 belongs to another run"):
        _save(tmp_path, 5, keep=2, value=torch.zeros(3))
    assert checkpoint.verify(tmp_path / "step_00000005") == 5
    assert torch.equal(checkpoint.load_weights(tmp_path / "step_00000005")[2]["w"], torch.full((3,), 5.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage.json", "step_00000005"]


def test_disk_full_leaves_no_temporary_dir_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 10, keep=2)

    def full_disk(state, f):
        f.write(b"PK\x03\x04 the first bytes")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError) as failure:
        _save(tmp_path, 20, keep=2)
    message = str(failure.value)
    assert str(tmp_path / "step_00000020") in message and "No space left on device (ENOSPC)" in message
    assert "latest still names step_00000010" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage.json", "step_00000010"]
    assert checkpoint.load_latest(tmp_path)[1] == 10


def test_a_writer_killed_mid_write_leaves_nothing_after_the_next_save(tmp_path, caplog):
    _save(tmp_path, 10, keep=5)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER_STUCK_MID_WRITE, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    left = tmp_path / f".step_00000020.{writer.pid}.tmp"
    assert (left / "__0_0.distcp").is_file()   # what the dead writer left: the previous checkpoint still loads
    assert checkpoint.load_latest(tmp_path)[1] == 10
    with caplog.at_level("WARNING", logger="dflash"):
        _save(tmp_path, 30, keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage.json", "step_00000010", "step_00000030"]
    assert f"removing {left}: a checkpoint writer (pid {writer.pid}) died while writing it" in caplog.text


def test_a_save_returns_before_its_write_and_appears_only_once_written(tmp_path, monkeypatch):
    _save(tmp_path, 10, keep=3)
    writing, release = threading.Event(), threading.Event()
    save = torch.save

    def slow_disk(value, file):   # DCP's writer thread, stopped in its write until released
        writing.set()
        release.wait(timeout=60)
        save(value, file)
    monkeypatch.setattr(torch, "save", slow_disk)
    writer = checkpoint.Checkpointer(tmp_path, keep=3)
    weight = torch.full((3,), 20.0)
    writer.save(20, [Piece.whole("model.w", weight)], {"step": 20, "drafter_config": {}, "shapes": {"w": [3]}})
    weight.fill_(-1.0)   # the training step after the save changes the state: the save holds its own copy
    assert writing.wait(timeout=60)
    # Written meanwhile, not yet published: readers see the previous checkpoint.
    assert checkpoint.load_latest(tmp_path) == (tmp_path / "step_00000010", 10)
    assert not (tmp_path / "step_00000020").exists()
    release.set()
    assert writer.close() == tmp_path / "step_00000020"
    assert checkpoint.load_latest(tmp_path)[1] == 20
    assert torch.equal(checkpoint.load_weights(tmp_path / "step_00000020")[2]["w"], torch.full((3,), 20.0))


# One of two ranks (argv: rank, checkpoints dir, store file): both save step 10, then step 20, in which rank 1
# stops for good in its write (the test kills it); rank 0 writes what its save of step 20 came to.
_RANK_STUCK_MID_SAVE = """
import datetime, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from launcher.run_io import checkpoint
rank, root = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[3], 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
writer = checkpoint.Checkpointer(root, 3, dist.group.WORLD)
pieces = [checkpoint.Piece("model.w", 4, 2 * rank, torch.full((2,), float(rank)))]
state = {"step": 10, "drafter_config": {}, "shapes": {"w": [4]}}
writer.save(10, pieces, state)
writer.wait()
if rank == 1:
    def stuck(value, file):
        file.write(b"PK\\x03\\x04 the first bytes")
        file.flush()
        (root / "rank1-writing").touch()
        time.sleep(600)
    torch.save = stuck
writer.save(20, pieces, {**state, "step": 20})
try:
    writer.wait()
    outcome = "published"
except checkpoint.CheckpointWriteError as exc:
    outcome = str(exc)
(root / f"rank{rank}-outcome").write_text(outcome)
os._exit(0)   # the peer is gone: no teardown of the process group
"""


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_latest(tmp_path):
    root = tmp_path / "checkpoints"
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK_STUCK_MID_SAVE, str(rank), str(root),
                               str(tmp_path / "store")], cwd=REPO) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not (root / "rank1-writing").exists():
            assert time.monotonic() < deadline and ranks[1].poll() is None, "rank 1 never wrote"
            time.sleep(0.1)
        ranks[1].send_signal(signal.SIGKILL)
        assert ranks[0].wait(timeout=120) == 0
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    outcome = (root / "rank0-outcome").read_text()
    assert outcome.startswith(f"could not write checkpoint {root / 'step_00000020'}") and \
        "latest still names step_00000010 and no temporary files were left" in outcome, outcome
    assert (root / "latest").read_text() == "step_00000010"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith((".", "step_"))) == ["step_00000010"]
    assert torch.equal(checkpoint.load_weights(root / "step_00000010")[2]["w"], torch.tensor([0.0, 0, 1, 1]))


def test_a_dead_writers_pointer_and_lineage_temporaries_go_too(tmp_path):
    _save(tmp_path, 10, keep=5)
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (f".latest.{dead.pid}.tmp", f".lineage.json.{dead.pid}.tmp"):
        (tmp_path / name).write_text("step_000")
    unrelated = tmp_path / "notes.txt"   # not a writer's temporary: never touched
    unrelated.write_text("mine")
    _save(tmp_path, 20, keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage.json", "notes.txt", "step_00000010",
                                                          "step_00000020"]


def test_the_save_timing_script_runs_at_a_tiny_shape(tmp_path, tiny_target_dir, capsys):
    """scripts/time_checkpoint_save.py, which times steps around a save at the 8B drafter on a GPU, on the
    CPU at the tiny shape: one rank writes the whole state (fp32 master and two moments per weight)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("time_checkpoint_save", REPO / "scripts" / "time_checkpoint_save.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(tmp_path), "--tiny", "--tokenizer", str(tiny_target_dir), "--warmup", "1", "--steps", "2",
                 "--after", "2"])
    result = json.loads((tmp_path / "checkpoint_save.json").read_text())
    assert result["state_bytes"] == 12 * result["params"]
    assert result["checkpoint_bytes"] > result["bytes_per_rank"]["0"] >= result["state_bytes"]
    assert len(result["step_s"]["all"]) == 2 and len(result["async"]["after_steps_s"]) == 2
    assert result["async"]["background_write_s"] >= result["async"]["save_call_s"] > 0
    assert "lost to a save: synchronous" in capsys.readouterr().out
    assert not (tmp_path / "checkpoints").exists()   # ~12 GB each at the 8B shape: removed unless --keep


def test_a_drafter_resumes_a_checkpoint_of_earlier_versions(tmp_path, tiny_target_dir):
    """What the lead drafter wrote before checkpoints were sharded (one state.pt: the gathered weights,
    torch AdamW's state by parameter index, the schedule, RNG states) restores a drafter: the weights,
    moments, update count, schedule and tokens seen it was saved with."""
    import dataclasses
    import random

    import torch.distributed as dist

    from launcher.config import compose_config
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve
    from launcher.roles.trainer import DrafterTrainer

    job = resolve(compose_config([f"target.path={tiny_target_dir}", f"data.cache_dir={tmp_path / 'tok'}"]),
                  Topology(1, 1), torch.device("cpu"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saved = DrafterTrainer(job, dist.group.WORLD)
        gen = torch.Generator().manual_seed(0)
        for piece in saved.checkpoint_pieces():
            piece.tensor.copy_(torch.randn(piece.tensor.shape, generator=gen))
        saved.optimizer._opt_called = True   # as its updates would have (torch's LR schedulers look for it)
        for _ in range(7):
            saved.scheduler.step()
        whole = {piece.key: piece.tensor.view(saved.checkpoint_state(7)["shapes"][piece.key.split(".", 1)[1]])
                 for piece in saved.checkpoint_pieces()}
        names = [name for name, _ in saved.optimizer.named]
        hyper = {key: value for key, value in saved.optimizer.param_groups[0].items() if key != "params"}
        old = {"step": 7, "model": {name: whole[f"model.{name}"] for name in names},
               "optimizer": {"state": {i: {"step": torch.tensor(7.0), "exp_avg": whole[f"exp_avg.{name}"],
                                           "exp_avg_sq": whole[f"exp_avg_sq.{name}"]} for i, name in enumerate(names)},
                             "param_groups": [{**hyper, "params": list(range(len(names)))}]},
               "scheduler": saved.scheduler.state_dict(), "rng": {"python": random.getstate(),
                                                                  "torch": torch.get_rng_state()},
               "drafter_config": dataclasses.asdict(job.drafter), "tokens_seen": 99}
        path = tmp_path / "step_00000007"
        path.mkdir()
        torch.save(old, path / "state.pt")
        (path / "meta.json").write_text(json.dumps({"step": 7}))

        resumed = DrafterTrainer(job, dist.group.WORLD)
        resumed.restore(path, None)
        for mine, theirs in zip(resumed.checkpoint_pieces(), saved.checkpoint_pieces()):
            assert mine.key == theirs.key and torch.equal(mine.tensor, theirs.tensor), mine.key
        assert resumed.optimizer.state_dict()["step"] == 7.0 and resumed.tokens_seen == 99
        assert resumed.scheduler.state_dict() == saved.scheduler.state_dict()
    finally:
        dist.destroy_process_group()
