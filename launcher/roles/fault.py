"""Test-only fault injection: make one rank die (SIGKILL), raise, or stop (SIGSTOP: alive to the
kernel, silent to its peers) at a chosen step or on entering a chosen start-up stage; or feed one
drafter NaN features from a chosen step on (kind=nan: the non-finite guard's test).

Fires on the first attempt only (torchrun's restart count 0), so a run under
`--max-restarts` recovers instead of failing the same way again.
"""
from __future__ import annotations

import os
import signal

from launcher.config.schema import FaultSettings


class InjectedFault(RuntimeError):
    pass


def _fire(fault: FaultSettings, rank: int, where: str) -> None:
    if fault.once and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if fault.kind in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        return
    raise InjectedFault(f"fault injected on rank {rank} at {where} (fault.kind=raise)")


def strikes(fault: FaultSettings, step: int) -> bool:
    """A fault fires on some rank at `step`. The drafters first settle their checkpoints then (every save
    before it published, launcher/roles/drafter.py), so which ones a test finds after the fault does not
    hang on how fast the disk wrote them in the background."""
    return fault.rank is not None and fault.stage is None and fault.step == step and fault.kind != "nan"


def maybe_fail(fault: FaultSettings, rank: int, step: int) -> None:
    if fault.rank == rank and strikes(fault, step):
        _fire(fault, rank, f"step {step}")


def poisons(fault: FaultSettings, rank: int, step: int) -> bool:
    """kind=nan: this rank's micro-batches carry NaN features from fault.step on."""
    return fault.kind == "nan" and fault.rank == rank and fault.step is not None and step >= fault.step


def maybe_fail_at_stage(fault: FaultSettings, rank: int, stage: str) -> None:
    if fault.rank == rank and fault.stage == stage:
        _fire(fault, rank, f"stage {stage}")
