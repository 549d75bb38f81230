"""Test-only fault injection: make one rank die (SIGKILL) or raise at a chosen step.

Fires on the first attempt only (torchrun's restart count 0), so a run under
`--max-restarts` recovers instead of failing the same way again.
"""
from __future__ import annotations

import os
import signal

from omegaconf import DictConfig


class InjectedFault(RuntimeError):
    pass


def maybe_fail(fault: DictConfig, rank: int, step: int) -> None:
    if fault.rank is None or fault.rank != rank or fault.step != step:
        return
    if fault.once and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"fault injected on rank {rank} at step {step} (fault.kind=raise)")
