"""A process that dies with its parent, however the parent dies (SIGKILL included): a killed
torchrun, bench or regeneration leaves no orphan writing checkpoints or holding GPUs. Linux asks
the kernel for it (PR_SET_PDEATHSIG); elsewhere the parent's own teardown is all there is.

The signal reaches only the process that asked, not the children it starts; a process that must
take its whole tree along (launcher/serving/supervisor.py) asks for a signal it can catch and
becomes a child subreaper, so that the descendants whose parents die are adopted by it, not by init."""
from __future__ import annotations

import ctypes
import functools
import os
import signal

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None   # not Linux


def die_with_parent(parent: int | None = None, death_signal: int = signal.SIGKILL) -> None:
    """This process gets `death_signal` (default SIGKILL) when its parent dies. `parent`: the
    parent's pid, known before a fork (default: this process's parent now)."""
    libc = _libc()
    if libc is None:
        return
    parent = os.getppid() if parent is None else parent
    libc.prctl(_PR_SET_PDEATHSIG, int(death_signal))
    if os.getppid() != parent:   # the parent died before prctl took effect
        os._exit(1)


def die_with_parent_preexec(death_signal: int = signal.SIGKILL):
    """A Popen preexec_fn making the child get `death_signal` when this process dies. libc is loaded
    here, in the parent, so the forked child only calls into it."""
    _libc()
    return functools.partial(die_with_parent, os.getpid(), death_signal)


def become_subreaper() -> bool:
    """Descendants of this process whose parent dies are reparented to it instead of init (and
    their exit reaped by it). False where the kernel offers no such thing (not Linux)."""
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0
