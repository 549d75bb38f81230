"""Heartbeats: every rank publishes its stage in torchrun's store, and every rank watches its peers'
beats for the whole run, so that whoever waits for a rank that stopped names it.

A daemon thread rewrites this rank's record (stage, a beat counter) every `interval` seconds and
reads its peers' records. A peer whose counter has not moved for run.timeout_s is stopped, hung or
dead: a rank waiting at a start-up meeting point raises PeerStalled naming it (rank, role, host,
pid, last stage); a rank blocked anywhere else, e.g. in a collective or a channel receive (C++, out
of Python's reach), is reported and ended by the watch thread itself (`on_stall`). Collectives wait
`collective_timeout_s`, a few beats longer than run.timeout_s, so the watch names the silent rank
before a collective times out naming only the rank that gave up waiting. A peer still beating is
waited for at meeting points up to run.startup_timeout_s, since loading a large target or compiling
the drafter can take many minutes. Waiting polls the store (a few ms at first), so meeting adds no
fixed delay. A rank that ends normally says so in its last record, so its silence is not a stall.

Every store call is bounded by run.timeout_s: a TCPStore call blocks past its own timeout when the
store's host is stopped (its socket stays open), and under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 that
host is rank 0 itself; a store that does not answer is a stall of its host, named like a peer's.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from launcher.config.schema import STARTUP_STAGES
from launcher.distributed.flight_recorder import dump_prefix

log = logging.getLogger("dflash")
_POLL_MAX_S = 0.05
_EXITED = "exited"   # the stage of a rank's last record when it ends normally
_LAST_BEAT_TIMEOUT_S = 5.0


class PeerStalled(TimeoutError):
    """A peer stopped reporting, or did not reach a meeting point in time; the message names it."""


@dataclass
class _Seen:
    beat: int
    since: float   # monotonic time this rank saw the beat change


def beat_interval(timeout_s: float) -> float:
    """Beats come often enough that a silent peer is told from a slow one well within run.timeout_s."""
    return max(0.1, min(5.0, timeout_s / 10))


def collective_timeout_s(timeout_s: float) -> float:
    """The process groups' timeout: run.timeout_s plus the watch's own delay (a peer's last beat is
    seen up to one interval late and reviewed once per interval) and 5 s for a busy host's
    scheduling, so a stopped peer is named by the watch before a collective waiting on it gives up."""
    return timeout_s + 3 * beat_interval(timeout_s) + 5.0


def _traces() -> str:
    """Where the ranks' NCCL flight records land, when their groups record (flight_recorder.py)."""
    prefix = dump_prefix()
    return (f"; each rank's last collectives (NCCL flight recorder) are in {Path(prefix).parent}, "
            f"{Path(prefix).name}<rank>" if prefix else "")


class StoreSilent(TimeoutError):
    """torchrun's store did not answer a call within run.timeout_s."""


class _BoundedStore:
    """A store client whose calls give up after `timeout_s`: one daemon thread makes them, the callers
    wait for its answer with a deadline (a hung call keeps that thread, and the calls queued after it
    time out too: by then the job is ending)."""

    def __init__(self, store, timeout_s: float):
        self._store, self.timeout_s = store, timeout_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="heartbeat-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            answer, method, args = self._calls.get()
            try:
                answer.set_result(getattr(self._store, method)(*args))
            except BaseException as exc:   # handed to the caller
                answer.set_exception(exc)

    def call(self, method: str, *args, timeout_s: float | None = None):
        """StoreSilent when the store did not answer within timeout_s (default: the store's); its own
        errors as raised."""
        answer: Future = Future()
        self._calls.put((answer, method, args))
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return answer.result(timeout=timeout_s)
        except TimeoutError:
            if answer.done():   # the store's own timeout, raised in time
                raise
            raise StoreSilent(f"no answer to {method} within {timeout_s:g} s") from None


class Heartbeat:
    def __init__(self, store, rank: int, roles: list[str], timeout_s: float, startup_timeout_s: float,
                 on_stage: Callable[[str], None] | None = None,
                 on_stall: Callable[[PeerStalled], None] | None = None):
        """on_stall: called from the watch thread when a peer stalls while this rank is not at a meeting
        point (which raises PeerStalled itself); None: the stall is only raised at meeting points."""
        self._store, self.rank, self.roles = _BoundedStore(store, timeout_s), rank, roles
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.interval = beat_interval(timeout_s)
        self._on_stage, self._on_stall = on_stage, on_stall
        self._lock = threading.Lock()   # the beat counter, bumped by this thread and the beat thread
        self._beat, self._stage, self._stage_t0 = 0, "starting", time.monotonic()
        self._note: str | None = None   # progress inside the stage (e.g. records tokenised)
        self._seen: dict[int, _Seen] = {}
        self._records: dict[int, dict] = {}     # each peer's last record read
        self._waiting_at: str | None = None     # the meeting point this rank waits at, if any
        self.stalled: PeerStalled | None = None   # the last stall the watch found
        self._notes: dict[int, tuple[str | None, float]] = {}   # a peer's last note and when it changed
        self._stop = threading.Event()
        self._answered(self._publish)
        self._thread = threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, rank: int, roles: list[str], timeout_s: float, startup_timeout_s: float,
                on_stage: Callable[[str], None] | None = None,
                on_stall: Callable[[PeerStalled], None] | None = None) -> Heartbeat:
        """A client of torchrun's store (MASTER_ADDR:MASTER_PORT), keys scoped to this job and attempt;
        it says this rank finished when the process exits normally, if nothing said it before."""
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        scope = (f"dflash/progress/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/"
                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
        heartbeat = cls(dist.PrefixStore(scope, store), rank, roles, timeout_s, startup_timeout_s, on_stage, on_stall)
        atexit.register(heartbeat.finish)
        return heartbeat

    # --------------------------------------------------------------------------- this rank
    def stage(self, name: str) -> None:
        """This rank now does `name` (one of STARTUP_STAGES); peers see it at once."""
        if name not in STARTUP_STAGES:
            raise ValueError(f"unknown start-up stage {name!r}: one of {STARTUP_STAGES}")
        self._stage, self._stage_t0, self._note = name, time.monotonic(), None
        log.info("stage: %s", name)
        self._answered(self._publish)
        if self._on_stage is not None:
            self._on_stage(name)

    def _next_record(self) -> str:
        with self._lock:
            self._beat += 1
            return json.dumps({"beat": self._beat, "stage": self._stage, "stage_s": time.monotonic() - self._stage_t0,
                               "host": socket.gethostname(), "pid": os.getpid(), "note": self._note})

    def _publish(self, timeout_s: float | None = None) -> None:
        self._store.call("set", f"beat/{self.rank}", self._next_record(), timeout_s=timeout_s)

    def note(self, text: str) -> None:
        """Progress inside this stage; the next beat publishes it. A peer whose note keeps changing is
        waited for beyond run.startup_timeout_s (a long tokenisation that is getting on)."""
        self._note = text

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                stalled = self._stalled_peer()
            except StoreSilent:
                stalled = self._store_host_stalled()
            except (RuntimeError, OSError) as exc:   # the store is gone: the job is ending
                log.debug("heartbeat not published or peers not read: %s", exc)
                continue
            if stalled is not None:
                self.stalled = stalled   # raised by wait_for at a meeting point
                if self._waiting_at is None and self._on_stall is not None:
                    self._on_stall(stalled)

    def close(self) -> None:
        """Stop beating (and watching)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)

    def finish(self) -> None:
        """This rank ends normally: stop, and tell the peers, so that its silence is not taken for a stall."""
        if self._stage == _EXITED:
            return
        self.close()
        self._stage = _EXITED
        try:
            self._publish(timeout_s=min(self.timeout_s, _LAST_BEAT_TIMEOUT_S))   # bounds this process's exit
        except (RuntimeError, OSError) as exc:
            log.debug("last heartbeat not published: %s", exc)

    # --------------------------------------------------------------------------- watching peers
    def _stalled_peer(self) -> PeerStalled | None:
        """A peer whose beat has not moved for run.timeout_s, if any."""
        for rank in range(len(self.roles)):
            if rank == self.rank:
                continue
            record = self._record(rank)
            if record is not None and record["stage"] == _EXITED:
                continue
            beat, now = (record["beat"] if record else -1), time.monotonic()
            seen = self._seen.get(rank)
            if seen is None or seen.beat != beat:
                self._seen[rank] = _Seen(beat, now)
            elif now - seen.since > self.timeout_s:
                return PeerStalled(f"{self._who(rank)} stopped reporting: no heartbeat for {now - seen.since:.0f} s "
                                   f"(run.timeout_s={self.timeout_s:g}) while rank {self.rank} {self._doing()}; "
                                   f"{self._last_stage(rank)}; it is stopped, hung or dead{_traces()}")
        return None

    def _store_host_stalled(self) -> PeerStalled:
        """The store did not answer for run.timeout_s: its host is stopped, hung or dead. Under
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0 hosts it; otherwise the torchrun agent does."""
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1" and self.rank != 0:
            host = f"{self._who(0)}, the host of torchrun's store at {where} (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),"
            last = f"; {self._last_stage(0)}"
        else:
            host, last = f"torchrun's store at {where} (the torchrun agent's)", ""
        return PeerStalled(f"{host} stopped answering: no answer for {self.timeout_s:g} s (run.timeout_s="
                           f"{self.timeout_s:g}) while rank {self.rank} {self._doing()}{last}; it is stopped, hung "
                           f"or dead")

    def _doing(self) -> str:
        return f"waited at '{self._waiting_at}'" if self._waiting_at else f"was at stage {self._stage}"

    def _last_stage(self, rank: int) -> str:
        record = self._records.get(rank)
        return (f"its last stage: {record['stage']} ({record['stage_s']:.0f} s in it)" if record
                else "this rank read no record of it (it stopped before this rank's first look, or never began)")

    # --------------------------------------------------------------------------- meeting peers
    def arrive(self, point: str) -> None:
        """Tell the peers this rank reached `point`."""
        self._answered(self._store.call, "set", f"at/{point}/{self.rank}", "1")

    def meet(self, point: str) -> None:
        """Every rank reaches `point` before any goes on (a barrier that names a stalled rank)."""
        self.arrive(point)
        self.wait_for(point, range(len(self.roles)))

    def wait_for(self, point: str, ranks) -> None:
        """Until every rank in `ranks` has arrived at `point`; PeerStalled naming a peer that stopped
        reporting for run.timeout_s, or the first still busy after run.startup_timeout_s."""
        keys = {rank: f"at/{point}/{rank}" for rank in ranks}
        started = time.monotonic()
        next_review, delay = started + self.interval, 0.002
        self._waiting_at = point
        try:
            while not self._answered(self._store.call, "check", list(keys.values())):
                if self.stalled is not None:
                    raise self.stalled
                now = time.monotonic()
                if now >= next_review and now - started > self.startup_timeout_s:
                    self._still_busy(point, [rank for rank, key in keys.items()
                                             if not self._answered(self._store.call, "check", [key])], now - started)
                    next_review = now + self.interval
                time.sleep(delay)
                delay = min(2 * delay, _POLL_MAX_S)
        finally:
            self._waiting_at = None

    def _answered(self, read, *args):
        """`read(*args)` (store calls) from the main thread: a store silent or gone is a PeerStalled naming
        its host."""
        try:
            return read(*args)
        except StoreSilent:
            raise self._store_host_stalled() from None
        except (RuntimeError, OSError) as exc:
            raise PeerStalled(f"torchrun's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                              f"failed ({exc}): its host (the torchrun agent, or rank 0 under "
                              f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is gone") from exc

    def _record(self, rank: int) -> dict | None:
        """Rank's record from the store (None before its first beat), kept to name it later."""
        if not self._store.call("check", [f"beat/{rank}"]):
            return None
        self._records[rank] = json.loads(self._store.call("get", f"beat/{rank}"))
        return self._records[rank]

    def _who(self, rank: int) -> str:
        record = self._records.get(rank)
        where = f" on host {record['host']} pid {record['pid']}" if record else ""
        return f"rank {rank} ({self.roles[rank]}{where}, logs/{self.roles[rank]}{rank}.log)"

    def _still_busy(self, point: str, pending: list[int], waited: float) -> None:
        now = time.monotonic()
        stuck = [rank for rank in pending if not self._progressing(rank, now)]
        if not stuck:
            return
        rank = stuck[0]
        record = self._answered(self._record, rank)
        stage = record["stage"] if record else "starting"
        raise PeerStalled(f"{self._who(rank)} is alive but still at stage {stage} after rank "
                          f"{self.rank} waited {waited:.0f} s at '{point}' (run.startup_timeout_s="
                          f"{self.startup_timeout_s:g}; raise it if loading or compiling is this slow)")

    def _progressing(self, rank: int, now: float) -> bool:
        """The rank's progress note changed within the last run.startup_timeout_s (its end counts as a
        change: the stage after a long tokenisation gets its own run.startup_timeout_s)."""
        record = self._answered(self._record, rank)
        note = record.get("note") if record else None
        last = self._notes.get(rank)
        if last is None or last[0] != note:
            self._notes[rank] = (note, now if last is not None or note is not None else -math.inf)
        return now - self._notes[rank][1] <= self.startup_timeout_s
