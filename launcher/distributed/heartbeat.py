"""Start-up progress: every rank publishes its stage in torchrun's store, and a rank waiting for its
peers names the one that stopped.

A daemon thread rewrites this rank's record (stage, a beat counter) every `interval` seconds. A rank
waiting at a start-up meeting point watches the peers it waits for: one whose counter has not moved
for run.timeout_s is stopped, hung or dead, and is named (rank, role, last stage) at once; one still
beating is waited for up to run.startup_timeout_s, since loading a large target or compiling the
drafter can take many minutes. Waiting polls the store (a few ms at first), so meeting adds no
fixed delay.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from launcher.config.schema import STARTUP_STAGES

log = logging.getLogger("dflash")
_POLL_MAX_S = 0.05


class PeerStalled(TimeoutError):
    """A peer stopped reporting, or did not reach a meeting point in time; the message names it."""


@dataclass
class _Seen:
    beat: int
    since: float   # monotonic time this rank saw the beat change


def beat_interval(timeout_s: float) -> float:
    """Beats come often enough that a silent peer is told from a slow one well within run.timeout_s."""
    return max(0.1, min(5.0, timeout_s / 10))


class StartupProgress:
    def __init__(self, store, rank: int, roles: list[str], timeout_s: float, startup_timeout_s: float,
                 on_stage: Callable[[str], None] | None = None):
        self._store, self.rank, self.roles = store, rank, roles
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.interval = beat_interval(timeout_s)
        self._on_stage = on_stage
        self._lock = threading.Lock()   # one store client, used by this thread and the beat thread
        self._beat, self._stage, self._stage_t0 = 0, "starting", time.monotonic()
        self._note: str | None = None   # progress inside the stage (e.g. records tokenised)
        self._seen: dict[int, _Seen] = {}
        self._notes: dict[int, tuple[str | None, float]] = {}   # a peer's last note and when it changed
        self._stop = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._beat_loop, name="startup-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def connect(cls, rank: int, roles: list[str], timeout_s: float, startup_timeout_s: float,
                on_stage: Callable[[str], None] | None = None) -> StartupProgress:
        """A client of torchrun's store (MASTER_ADDR:MASTER_PORT), keys scoped to this job and attempt."""
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        scope = (f"dflash/progress/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/"
                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
        return cls(dist.PrefixStore(scope, store), rank, roles, timeout_s, startup_timeout_s, on_stage)

    # --------------------------------------------------------------------------- this rank
    def stage(self, name: str) -> None:
        """This rank now does `name` (one of STARTUP_STAGES); peers see it at once."""
        if name not in STARTUP_STAGES:
            raise ValueError(f"unknown start-up stage {name!r}: one of {STARTUP_STAGES}")
        self._stage, self._stage_t0, self._note = name, time.monotonic(), None
        log.info("stage: %s", name)
        self._publish()
        if self._on_stage is not None:
            self._on_stage(name)

    def _publish(self) -> None:
        with self._lock:
            self._beat += 1
            record = {"beat": self._beat, "stage": self._stage, "stage_s": time.monotonic() - self._stage_t0,
                      "host": socket.gethostname(), "pid": os.getpid(), "note": self._note}
            self._store.set(f"beat/{self.rank}", json.dumps(record))

    def note(self, text: str) -> None:
        """Progress inside this stage; the next beat publishes it. A peer whose note keeps changing is
        waited for beyond run.startup_timeout_s (a long tokenisation that is getting on)."""
        self._note = text

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
            except (RuntimeError, OSError) as exc:   # the store is gone: the job is ending
                log.debug("heartbeat not published: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)

    # --------------------------------------------------------------------------- meeting peers
    def arrive(self, point: str) -> None:
        """Tell the peers this rank reached `point`."""
        with self._lock:
            self._store.set(f"at/{point}/{self.rank}", "1")

    def meet(self, point: str) -> None:
        """Every rank reaches `point` before any goes on (a barrier that names a stalled rank)."""
        self.arrive(point)
        self.wait_for(point, range(len(self.roles)))

    def wait_for(self, point: str, ranks) -> None:
        """Until every rank in `ranks` has arrived at `point`; PeerStalled naming the first that stopped
        reporting for run.timeout_s, or that is still busy after run.startup_timeout_s."""
        keys = {rank: f"at/{point}/{rank}" for rank in ranks}
        started = time.monotonic()
        next_review, delay = started + self.interval, 0.002
        while not self._has(list(keys.values())):
            now = time.monotonic()
            if now >= next_review:
                self._review(point, [rank for rank, key in keys.items() if not self._has([key])], now - started)
                next_review = now + self.interval
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def _has(self, keys: list[str]) -> bool:
        try:
            with self._lock:
                return self._store.check(keys)
        except (RuntimeError, OSError) as exc:
            raise PeerStalled(f"torchrun's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                              f"did not answer within run.timeout_s={self.timeout_s:g}: its host (the torchrun "
                              f"agent, or rank 0 under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is stopped or gone "
                              f"({exc})") from exc

    def _record(self, rank: int) -> dict | None:
        if not self._has([f"beat/{rank}"]):
            return None
        with self._lock:
            return json.loads(self._store.get(f"beat/{rank}"))

    def _who(self, rank: int, record: dict | None) -> str:
        where = f" on host {record['host']} pid {record['pid']}" if record else ""
        return f"rank {rank} ({self.roles[rank]}{where}, logs/{self.roles[rank]}{rank}.log)"

    def _review(self, point: str, pending: list[int], waited: float) -> None:
        now = time.monotonic()
        for rank in pending:
            record = self._record(rank)
            beat = record["beat"] if record else -1
            seen = self._seen.get(rank)
            if seen is None or seen.beat != beat:
                self._seen[rank] = _Seen(beat, now)
            elif now - seen.since > self.timeout_s:
                last = (f"its last stage: {record['stage']} ({record['stage_s']:.0f} s in it)" if record
                        else "it never reported a stage")
                raise PeerStalled(f"{self._who(rank, record)} stopped reporting: no heartbeat for "
                                  f"{now - seen.since:.0f} s (run.timeout_s={self.timeout_s:g}) while rank "
                                  f"{self.rank} waited at '{point}'; {last}; it is stopped, hung or dead")
        stuck = [rank for rank in pending if not self._progressing(rank, now)]
        if waited > self.startup_timeout_s and stuck:
            rank = stuck[0]
            record = self._record(rank)
            stage = record["stage"] if record else "starting"
            raise PeerStalled(f"{self._who(rank, record)} is alive but still at stage {stage} after rank "
                              f"{self.rank} waited {waited:.0f} s at '{point}' (run.startup_timeout_s="
                              f"{self.startup_timeout_s:g}; raise it if loading or compiling is this slow)")

    def _progressing(self, rank: int, now: float) -> bool:
        """The rank's progress note changed within the last run.startup_timeout_s (its end counts as a
        change: the stage after a long tokenisation gets its own run.startup_timeout_s)."""
        record = self._record(rank)
        note = record.get("note") if record else None
        last = self._notes.get(rank)
        if last is None or last[0] != note:
            self._notes[rank] = (note, now if last is not None or note is not None else -math.inf)
        return now - self._notes[rank][1] <= self.startup_timeout_s
