"""A process that dies with its parent, however the parent dies (SIGKILL included): a killed
torchrun, bench or regeneration leaves no orphan writing checkpoints or holding GPUs. Linux asks
the kernel for it (PR_SET_PDEATHSIG); elsewhere the parent's own teardown is all there is."""
from __future__ import annotations

import ctypes
import functools
import os
import signal

_PR_SET_PDEATHSIG = 1


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None   # not Linux


def die_with_parent(parent: int | None = None) -> None:
    """This process gets SIGKILL when its parent dies. `parent`: the parent's pid, known before a
    fork (default: this process's parent now)."""
    libc = _libc()
    if libc is None:
        return
    parent = os.getppid() if parent is None else parent
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:   # the parent died before prctl took effect
        os._exit(1)


def die_with_parent_preexec():
    """A Popen preexec_fn making the child die with this process. libc is loaded here, in the parent,
    so the forked child only calls into it."""
    _libc()
    return functools.partial(die_with_parent, os.getpid())
