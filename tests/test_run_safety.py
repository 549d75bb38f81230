"""One job per run dir (launcher/run_io/lock.py) and start-up waits that name a stalled rank
(launcher/distributed/heartbeat.py), in one process: fast."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.distributed import flight_recorder, heartbeat
from launcher.distributed.heartbeat import Heartbeat, PeerStalled
from launcher.run_io import lock
from launcher.run_io.lock import LockBusy, RunLock


# ----------------------------------------------------------------------------------- the lock
def _write_holder(run_dir, **changes):
    """A lock as another job would have left it (this process's identity, then `changes`)."""
    record = {**lock._identity(), **changes}
    (run_dir / lock.LOCK_NAME).write_text(json.dumps(record))
    return record


def test_a_live_holder_is_named_and_a_released_lock_is_free(tmp_path):
    held = RunLock.acquire(tmp_path)
    with pytest.raises(LockBusy, match=rf"is in use by another job: host \S+ pid {held.record['pid']} .*started "
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
        with pytest.raises(LockBusy):
            RunLock.acquire(tmp_path)


# ----------------------------------------------------------------------------------- start-up progress
@pytest.fixture
def store():
    """A stand-in for torchrun's store."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _progress(store, rank, timeout_s=1.0, startup_timeout_s=30.0, roles=("target", "drafter"), on_stall=None,
              port=None):
    client = dist.TCPStore("127.0.0.1", port or store.port, is_master=False, timeout=timedelta(seconds=10))
    return Heartbeat(dist.PrefixStore("job/0/", client), rank, list(roles), timeout_s, startup_timeout_s,
                     on_stall=on_stall)


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


def test_a_stall_on_nccl_groups_names_where_each_ranks_flight_record_lands(store, tmp_path, monkeypatch):
    for name, value in {**flight_recorder.recording_env(), **flight_recorder.dump_env(tmp_path)}.items():
        monkeypatch.setenv(name, value)   # what an NCCL rank's start-up sets
    target, drafter = _progress(store, 0), _progress(store, 1)
    drafter.close()
    with pytest.raises(PeerStalled, match=rf"it is stopped, hung or dead; each rank's last collectives \(NCCL flight "
                                          rf"recorder\) are in {tmp_path / 'flight_recorder'}, rank_<rank>$"):
        target.meet("stream")
    target.close()


def test_nccl_groups_record_and_dump_into_the_run_dir_unless_the_user_said_otherwise(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}   # the user's own, under the older name torch still reads
    flight_recorder.set_unless_given(flight_recorder.recording_env(), environ)
    flight_recorder.dump_into(tmp_path, environ)
    assert environ == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                       "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path / 'flight_recorder'}/rank_"}
    assert (tmp_path / "flight_recorder").is_dir()
    mine = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path / 'mine'}/trace_", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    theirs = dict(mine)
    flight_recorder.dump_into(tmp_path, theirs)
    assert theirs == mine
    assert (tmp_path / "mine").is_dir() and flight_recorder.dump_prefix(theirs) == f"{tmp_path / 'mine'}/trace_"
    assert flight_recorder.dump_prefix({}) is None   # gloo groups (CPU): no record, nothing named


def test_a_rank_alive_but_still_busy_is_waited_for_up_to_the_startup_timeout(store):
    target, drafter = _progress(store, 0, startup_timeout_s=2.5), _progress(store, 1, startup_timeout_s=2.5)
    drafter.stage("loading_target")   # beating, never arriving
    started = time.monotonic()
    with pytest.raises(PeerStalled, match=r"rank 1 \(drafter.*is alive but still at stage loading_target after rank 0 "
                                          r"waited \d+ s at 'stream' \(run.startup_timeout_s=2.5"):
        target.meet("stream")
    assert time.monotonic() - started > 2.5   # well past run.timeout_s=1: a live peer is not a stalled one
    target.close(), drafter.close()


def test_the_watch_names_a_stopped_peer_wherever_this_rank_is_and_not_one_that_finished(store):
    """Rank 0 is busy elsewhere (not at a meeting point, as in a collective): its watch thread reports
    the peer that stopped beating, not the one that ended normally."""
    stalls = []
    roles = ("target", "drafter", "drafter")
    target = _progress(store, 0, roles=roles, on_stall=stalls.append)
    finished, stopped = _progress(store, 1, roles=roles), _progress(store, 2, roles=roles)
    target.stage("streaming")
    finished.finish()
    stopped.close()   # as if SIGSTOPped: no more beats
    started = time.monotonic()
    while not stalls and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert stalls, "no stall reported"
    waited = time.monotonic() - started
    assert 1.0 < waited < 1.0 + 3 * heartbeat.beat_interval(1.0) + 2, waited   # slack for a loaded machine
    assert re.match(r"rank 2 \(drafter on host \S+ pid \d+, logs/drafter2.log\) stopped reporting: no heartbeat for "
                    r"\d+ s \(run.timeout_s=1\) while rank 0 was at stage streaming", str(stalls[0])), stalls[0]
    assert all("rank 2 " in str(stall) for stall in stalls)   # the finished rank 1 is never named
    target.close()


def test_a_stopped_store_host_is_named_and_nothing_waits_on_it_forever(monkeypatch):
    """Under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0 hosts torchrun's store; stopped, it leaves the
    store's socket open, and a store call would block past its own timeout."""
    server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                               "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
                               "print(s.port, flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        host = _progress(None, 0, port=port)
        host.stage("loading_target")
        drafter = _progress(None, 1, port=port)
        time.sleep(3 * heartbeat.beat_interval(1.0))   # the drafter reads rank 0's record
        host.close()
        os.kill(server.pid, signal.SIGSTOP)   # rank 0, with its store
        started = time.monotonic()
        with pytest.raises(PeerStalled, match=r"rank 0 \(target on host \S+ pid \d+, logs/target0.log\), the host of "
                                              rf"torchrun's store at 127.0.0.1:{port} \(TORCH_DISABLE_SHARE_RDZV_TCP_"
                                              r"STORE=1\), stopped answering: .* its last stage: loading_target"):
            drafter.meet("stream")
        assert time.monotonic() - started < 1.0 + 3 * heartbeat.beat_interval(1.0) + 2   # slack for a loaded machine
        drafter.close()
    finally:
        server.kill()


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
