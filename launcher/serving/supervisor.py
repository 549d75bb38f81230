"""`python -m launcher.serving.supervisor GRACE_S [--log-to-remove PATH] -- COMMAND ...`: run a
server's command so that its whole process tree ends with the command that started it.

vLLM's API server starts an engine core, which starts its workers, and multiprocessing's
resource_tracker; none of them inherits the parent-death signal of the API server, and a process
whose parent dies is adopted by init, out of anyone's reach. VllmServer therefore starts this
supervisor (the main environment's python, standard library only), in a session of its own and
with SIGHUP as its parent-death signal, and the supervisor starts the command. Being a child
subreaper, it adopts every process of the tree whose parent dies, so the tree is always its
descendants. It stops them all, SIGTERM first and SIGKILL to those left after the grace, when:
- it gets SIGTERM or SIGINT (VllmServer.stop());
- it gets SIGHUP: the kernel's word that the command that started it died, however it died (its
  parent pid may not have changed yet: another thread of the dying command adopts it first); the
  temporary log of --log-to-remove goes too, as no one is left to name it;
- the command exits on its own (an API server that died leaves its engine running).
The grace is GRACE_S once VllmServer said the server is ready (SIGUSR1; said in the log): a ready
server drains its requests and frees its memory on SIGTERM. Before, there is nothing to drain, and
vLLM starting up (loading, compiling) leaves SIGTERM unanswered: its tree would stay for the whole
grace, so it gets STARTUP_GRACE_S. The supervisor then exits with the command's status (128 + N for
a signal N), or 128 + the signal that stopped it when the command was still running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.parent_death import become_subreaper, die_with_parent_preexec

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
READY_SIGNAL = signal.SIGUSR1   # VllmServer's word that the server answers /health
# Before ready: time for the processes that do answer SIGTERM (an engine core exits within a second)
# to exit on their own, short next to any start-up.
STARTUP_GRACE_S = 2.0
LINE_PREFIX = "[supervisor "   # its lines in the server's log
READY_WORDS = "the server is ready"   # of its line when told so; any other line of it starts the teardown


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_interruptible = [True]   # while the server runs; the teardown is never interrupted
_ready = [False]          # told by READY_SIGNAL
_grace_s = [0.0]          # GRACE_S, for the ready line


def _on_stop_signal(signum, frame) -> None:
    if _interruptible[0]:
        _interruptible[0] = False
        raise _Stopped(signum)


def _on_ready_signal(signum, frame) -> None:
    if _interruptible[0] and not _ready[0]:
        _ready[0] = True
        _say(f"{READY_WORDS}: stopping it now gives its processes {_grace_s[0]:.0f} s to exit before SIGKILL")


def _say(message: str) -> None:
    # stdout is the server's log. os.write, not print: it is also called from a signal handler,
    # where print's buffer may be in use by the interrupted code.
    os.write(1, f"{LINE_PREFIX}{os.getpid()}] {message}\n".encode())


def is_teardown_line(line: str) -> bool:
    """Whether a line of the server's log is the supervisor saying the server exited or is being
    stopped: what the server logs after it is the teardown's."""
    return line.startswith(LINE_PREFIX) and READY_WORDS not in line


def is_ready_line(line: str) -> bool:
    """Whether a line of the server's log is the supervisor saying the server became ready."""
    return line.startswith(LINE_PREFIX) and READY_WORDS in line


def descendants(root: int) -> dict[int, str]:
    """pid -> state letter (R, S, Z, ...) of every process below `root`, read from /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:   # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        children.setdefault(int(ppid), []).append(int(entry.name))
        states[int(entry.name)] = state
    found, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found[child] = states[child]
            stack.append(child)
    return found


def _reap(statuses: dict[int, int]) -> None:
    """Collect every exited child (adopted ones too) without blocking, their statuses into `statuses`."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = status


def _signal_alive(sig: int) -> int:
    """Send `sig` to every live descendant; how many there were."""
    alive = [pid for pid, state in descendants(os.getpid()).items() if state != "Z"]
    for pid in alive:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return len(alive)


def stop_tree(grace_s: float, statuses: dict[int, int]) -> None:
    """SIGTERM to every descendant, SIGKILL after grace_s to those left (and to any they start
    meanwhile), until none is left; each reaped."""
    deadline = time.monotonic() + grace_s
    left = _signal_alive(signal.SIGTERM)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        _reap(statuses)
        left = sum(state != "Z" for state in descendants(os.getpid()).values())
    if left:
        _say(f"{left} processes left after {grace_s:.0f} s: SIGKILL")
    # Killed parents' children are adopted here and found by the next pass. A process in an
    # uninterruptible wait dies when it leaves it: bounded, so this process always ends.
    deadline = time.monotonic() + max(grace_s, 10.0)
    while _signal_alive(signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap(statuses)
    _reap(statuses)


def exit_code(status: int) -> int:
    """A wait status as a shell gives it: the exit code, or 128 + N for a signal N."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    at = argv.index("--")
    options, command = argv[:at], argv[at + 1:]
    grace_s = _grace_s[0] = float(options[0])
    log_to_remove = options[options.index("--log-to-remove") + 1] if "--log-to-remove" in options else None
    become_subreaper()
    for stop in _STOP_SIGNALS:
        signal.signal(stop, _on_stop_signal)
    signal.signal(READY_SIGNAL, _on_ready_signal)
    statuses: dict[int, int] = {}
    server = None
    try:
        # It dies with this process however this process dies (the server's own last resort).
        server = subprocess.Popen(command, preexec_fn=die_with_parent_preexec())
        while server.pid not in statuses:
            pid, status = os.waitpid(-1, 0)   # adopted orphans exit here too
            statuses[pid] = status
        _interruptible[0] = False
        server.returncode = code = exit_code(statuses[server.pid])   # reaped here, not by Popen
        _say(f"the server (pid {server.pid}) exited with code {code}; stopping the processes it left")
    except _Stopped as stopped:
        code = 128 + stopped.signum
        parent_died = stopped.signum == signal.SIGHUP
        why = "the command that started it died" if parent_died else f"told to ({signal.Signals(stopped.signum).name})"
        _say(f"stopping the server{f' (pid {server.pid})' if server else ''} and every process it started: {why}")
        if log_to_remove and parent_died:
            Path(log_to_remove).unlink(missing_ok=True)
    stop_tree(grace_s if _ready[0] else min(grace_s, STARTUP_GRACE_S), statuses)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
