"""One job per run dir (launcher/run_io/lock.py) and start-up waits that name a stalled rank
(launcher/distributed/heartbeat.py), in one process: fast."""
import json
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.distributed import heartbeat
from launcher.distributed.heartbeat import PeerStalled, StartupProgress
from launcher.run_io import lock
from launcher.run_io.lock import RunDirBusy, RunLock


# ----------------------------------------------------------------------------------- the lock
def _write_holder(run_dir, **changes):
    """A lock as another job would have left it (this process's identity, then `changes`)."""
    record = {**lock._identity(), **changes}
    (run_dir / lock.LOCK_NAME).write_text(json.dumps(record))
    return record


def test_a_live_holder_is_named_and_a_released_lock_is_free(tmp_path):
    held = RunLock.acquire(tmp_path)
    with pytest.raises(RunDirBusy, match=rf"is in use by another job: host \S+ pid {held.record['pid']} .*started "
                                         rf".*delete {tmp_path / lock.LOCK_NAME}"):
        RunLock.acquire(tmp_path)
    held.release()
    assert not (tmp_path / lock.LOCK_NAME).exists()
    RunLock.acquire(tmp_path).release()


def test_the_lock_of_a_dead_job_on_this_machine_is_taken_over(tmp_path, caplog):
    # A job killed with SIGKILL: its rank 0 and its torchrun agent are gone.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    _write_holder(tmp_path, pid=pid, pid_start=1, agent_pid=pid, agent_start=1, run_id="old-job")
    with caplog.at_level("WARNING", logger="dflash"):
        taken = RunLock.acquire(tmp_path)
    assert "taking over the lock of host" in caplog.text and "its processes on this machine are gone" in caplog.text
    taken.release()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    # The recorded pid now belongs to another process (this one): its start time differs.
    _write_holder(tmp_path, pid_start=1, agent_start=1)
    RunLock.acquire(tmp_path).release()


def test_a_restart_of_the_same_torchrun_job_takes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _write_holder(tmp_path, run_id="job-1", attempt=0, machine="another-node")   # rank 0 moved hosts, too
    RunLock.acquire(tmp_path).release()


@pytest.mark.parametrize("silent_s,stale", [(30, False), (lock.STALE_S + 60, True)])
def test_a_lock_from_another_machine_is_stale_once_not_refreshed(tmp_path, silent_s, stale):
    holder = _write_holder(tmp_path, machine="another-node", run_id="other-job", refreshed=time.time() - silent_s)
    reason = lock.stale_reason(holder, lock._identity())
    assert (reason is not None) == stale
    if not stale:
        with pytest.raises(RunDirBusy):
            RunLock.acquire(tmp_path)


# ----------------------------------------------------------------------------------- start-up progress
@pytest.fixture
def store():
    """A stand-in for torchrun's store."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _progress(store, rank, timeout_s=1.0, startup_timeout_s=30.0):
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    return StartupProgress(dist.PrefixStore("job/0/", client), rank, ["target", "drafter"], timeout_s,
                           startup_timeout_s)


def test_meeting_peers_that_arrive_adds_no_delay(store):
    target, drafter = _progress(store, 0), _progress(store, 1)
    later = threading.Thread(target=drafter.meet, args=("stream",))
    later.start()
    started = time.monotonic()
    target.meet("stream")
    later.join()
    assert time.monotonic() - started < 0.5
    target.close(), drafter.close()


def test_a_stopped_rank_is_named_within_the_timeout(store):
    target, drafter = _progress(store, 0), _progress(store, 1)
    drafter.stage("compiling")
    drafter.close()   # as if SIGSTOPped: no more beats, never arrives
    started = time.monotonic()
    with pytest.raises(PeerStalled, match=r"rank 1 \(drafter on host \S+ pid \d+, logs/drafter1.log\) stopped "
                                          r"reporting: no heartbeat for \d+ s \(run.timeout_s=1\) while rank 0 waited "
                                          r"at 'stream'; its last stage: compiling"):
        target.meet("stream")
    waited = time.monotonic() - started
    assert 1.0 < waited < 1.0 + 3 * heartbeat.beat_interval(1.0) + 2, waited   # slack for a loaded machine
    target.close()


def test_a_rank_alive_but_still_busy_is_waited_for_up_to_the_startup_timeout(store):
    target, drafter = _progress(store, 0, startup_timeout_s=2.5), _progress(store, 1, startup_timeout_s=2.5)
    drafter.stage("loading_target")   # beating, never arriving
    started = time.monotonic()
    with pytest.raises(PeerStalled, match=r"rank 1 \(drafter.*is alive but still at stage loading_target after rank 0 "
                                          r"waited \d+ s at 'stream' \(run.startup_timeout_s=2.5"):
        target.meet("stream")
    assert time.monotonic() - started > 2.5   # well past run.timeout_s=1: a live peer is not a stalled one
    target.close(), drafter.close()


def test_a_rank_tokenising_past_the_startup_timeout_while_reporting_progress_is_waited_for(store):
    target, drafter = _progress(store, 0, startup_timeout_s=1.5), _progress(store, 1, startup_timeout_s=1.5)

    def tokenise_then_arrive():
        target.stage("tokenising")
        for done in range(1, 11):        # 3 s of tokenising, twice run.startup_timeout_s, progress all along
            time.sleep(0.3)
            target.note(f"tokenised {done * 100} of 1000 records")
        target.stage("loading_target")   # the next stage starts its own run.startup_timeout_s
        time.sleep(0.5)
        target.arrive("stream")

    worker = threading.Thread(target=tokenise_then_arrive)
    started = time.monotonic()
    worker.start()
    drafter.meet("stream")
    worker.join()
    assert time.monotonic() - started > 3.0
    # Progress that stops counts as none: the startup timeout applies from the last change.
    target.stage("tokenising")
    target.note("tokenised 100 of 1000 records")
    with pytest.raises(PeerStalled, match=r"rank 0 \(target.*is alive but still at stage tokenising"):
        drafter.wait_for("later", [0])
    target.close(), drafter.close()
