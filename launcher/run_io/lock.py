"""One job per place it writes: a training run takes `run.dir/job.lock` at start (rank 0), a
regeneration `<output>.lock` (launcher/regeneration/parts.py), and the holder is named to any other job.

The lock records the host, the holder's pid and, under torchrun, its agent's pid (with their start
times, so a reused pid is not mistaken for the holder), torchrun's job id and attempt, the command
line, and when it was taken and last refreshed. A lock left behind by a job that died (a crash, a
SIGKILL) is stale, and the next job takes it over with a warning, when:
- it was taken by an earlier attempt of the same torchrun job (same TORCHELASTIC_RUN_ID, lower
  attempt number: `--max-restarts` after a failure), on any host; or
- it was taken on this machine (same kernel boot and pid namespace) and neither its holder nor its
  torchrun agent still runs (without torchrun the parent is a shell that outlives the job: not
  recorded); or
- it was taken on another machine and its holder has not refreshed it for `STALE_S` seconds (the
  holder rewrites it every `REFRESH_S` seconds; the clocks of the hosts must agree to a minute).
It is released at a clean end of the process; a failing process leaves it, stale, behind.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from dflash_core.files.durable import write_atomic

log = logging.getLogger("dflash")
LOCK_NAME = "job.lock"
REFRESH_S = 20.0
STALE_S = 120.0


class LockBusy(OSError):
    """Another live job holds the lock."""


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _machine() -> str:
    """Same value only in processes that see one another's pids: one kernel boot, one pid namespace."""
    boot = _read_text("/proc/sys/kernel/random/boot_id") or socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{boot}/{namespace}"


def _start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None when no such live process exists."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _running(pid: int, start: int | None) -> bool:
    """`pid` is still the process that had start time `start` (None: no /proc, the pid alone decides)."""
    if start is not None:
        return _start_ticks(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _identity() -> dict:
    pid, run_id = os.getpid(), os.environ.get("TORCHELASTIC_RUN_ID", "")
    agent = os.getppid() if run_id else None
    now = time.time()
    return {"host": socket.gethostname(), "machine": _machine(), "pid": pid, "pid_start": _start_ticks(pid),
            "agent_pid": agent, "agent_start": None if agent is None else _start_ticks(agent), "run_id": run_id,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "command": shlex.join(sys.orig_argv),
            "started": now, "refreshed": now, "token": uuid.uuid4().hex}


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    torchrun = (f" (torchrun job {holder['run_id']} attempt {holder['attempt']}, agent pid {holder['agent_pid']})"
                if holder.get("run_id") else "")
    command = holder.get("command", "?")
    return (f"host {holder['host']} pid {holder['pid']}{torchrun} started {started}, running "
            f"{command if len(command) <= 300 else command[:300] + ' ...'}")


def stale_reason(holder: dict, me: dict, now: float | None = None) -> str | None:
    """Why `holder`'s lock no longer protects a live job, or None when it may still (see the module doc)."""
    if holder["run_id"] and holder["run_id"] == me["run_id"] and holder["attempt"] < me["attempt"]:
        return f"it was taken by attempt {holder['attempt']} of this torchrun job"
    if holder["machine"] == me["machine"]:
        agent = holder.get("agent_pid")
        if _running(holder["pid"], holder["pid_start"]) or (agent is not None
                                                             and _running(agent, holder["agent_start"])):
            return None
        return "its processes on this machine are gone"
    silent = (time.time() if now is None else now) - holder["refreshed"]
    if silent > STALE_S:
        return f"its holder on another machine has not refreshed it for {silent:.0f} s (> {STALE_S:.0f} s)"
    return None


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return None   # torn by a writer killed mid-write (writes are atomic, so only from outside): stale


@contextlib.contextmanager
def _guard(directory: Path):
    """Serialise the check-and-take of jobs starting at once (flock on the lock's directory; best
    effort where the filesystem has no flock)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class RunLock:
    """A held lock; as a context manager, released on leaving (an error included: the job ends)."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="run-lock", daemon=True)

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Take the lock of `run_dir`, or raise LockBusy naming the live job that holds it."""
        return cls.take(Path(run_dir) / LOCK_NAME, f"run.dir={str(run_dir)!r}", "pick another run.dir")

    @classmethod
    def take(cls, path: Path, setting: str, elsewhere: str) -> RunLock:
        """Take the lock file `path` (its directory exists), guarding what `setting` ("key=value")
        names, or raise LockBusy naming the live job that holds it; `elsewhere`: the other remedy
        than waiting ("pick another run.dir")."""
        path, me = Path(path), _identity()
        with _guard(path.parent):
            holder = _read(path)
            if holder is not None:
                why = stale_reason(holder, me)
                if why is None:
                    raise LockBusy(f"{setting} is in use by another job: {describe(holder)}; wait for it to end or "
                                   f"{elsewhere} (if that job is dead, delete {path})")
                log.warning("taking over the lock of %s (%s): %s", describe(holder), path, why)
            write_atomic(path, json.dumps(me))
        lock = cls(path, me)
        lock._thread.start()
        atexit.register(lock.release)
        return lock

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            holder = _read(self.path)
            if holder is None or holder["token"] != self.record["token"]:
                log.error("the lock %s was taken over by %s", self.path, describe(holder) if holder else "nobody")
                return
            self.record["refreshed"] = time.time()
            with contextlib.suppress(OSError):
                write_atomic(self.path, json.dumps(self.record))

    def release(self) -> None:
        """Remove the lock if it is still this job's (a clean end)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        holder = _read(self.path)
        if holder is not None and holder["token"] == self.record["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
