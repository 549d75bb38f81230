"""NCCL's flight recorder, on for every NCCL process group: torch keeps each rank's last collectives in a
ring buffer and writes it to <run.dir>/flight_recorder/rank_<global rank> when a collective times out
(heartbeat.collective_timeout_s) or fails, and this process writes it too when the heartbeat's watch
ends it for a stalled peer, so a hang leaves per-rank traces (`python -m
torch.distributed.flight_recorder.fr_trace <dir>` names the rank that did not join which collective).

torch reads the buffer size and the dump switch when the first NCCL group is made, and the dump path only
when it writes its first dump; the run dir is agreed over the groups, so the path is set once it is known.
A variable the user set (under either name torch reads) is kept.
"""
from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger("dflash")
DUMP_DIR = "flight_recorder"
DUMP_PREFIX = "TORCH_FR_DUMP_TEMP_FILE"
# The older name torch 2.11-2.14 still reads for each setting (c10d's FlightRecorder and DebugInfoWriter).
_OLDER_NAME = {"TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE", DUMP_PREFIX: "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}


def recording_env() -> dict[str, str]:
    """What makes the NCCL groups record and dump: set before the first one is made."""
    return {"TORCH_FR_BUFFER_SIZE": "2000",          # collectives kept per rank (torch's documented choice)
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",       # write the record when a collective times out or fails
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}  # then end the process (the group's timeout is run.timeout_s's)


def dump_env(run_dir: Path) -> dict[str, str]:
    """Where the dumps land: torch appends each rank's global rank to this prefix."""
    return {DUMP_PREFIX: f"{Path(run_dir) / DUMP_DIR}/rank_"}


def dump_into(run_dir: Path, environ: MutableMapping[str, str] = os.environ) -> None:
    """Dumps land in `run_dir` (unless the user named another place), in a directory that exists."""
    set_unless_given(dump_env(run_dir), environ)
    Path(environ.get(DUMP_PREFIX) or environ[_OLDER_NAME[DUMP_PREFIX]]).parent.mkdir(parents=True, exist_ok=True)


def set_unless_given(env: dict[str, str], environ: MutableMapping[str, str] = os.environ) -> None:
    """Set each variable of `env` that the user did not set under either of its names."""
    for name, value in env.items():
        if not any(given in environ for given in (name, _OLDER_NAME.get(name, name))):
            environ[name] = value


def dump_prefix(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """The prefix the dumps of this process are written under, when its NCCL groups record."""
    prefix = environ.get(DUMP_PREFIX) or environ.get(_OLDER_NAME[DUMP_PREFIX])
    dumps = environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").lower() in ("1", "true", "yes", "y")
    return prefix if prefix and dumps else None


def dump_now(rank: int) -> None:
    """Write this rank's record where a timeout would (before the watch ends the process, which a
    collective's timeout then never reaches); nothing when its groups do not record."""
    import torch
    prefix, dump = dump_prefix(), getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)   # CUDA builds
    if prefix is None or dump is None:
        return
    try:
        Path(f"{prefix}{rank}").write_bytes(dump())
    except (OSError, RuntimeError) as exc:   # the job is ending anyway: say so, do not hide the stall
        log.warning("flight recorder: could not write %s%d: %s", prefix, rank, exc)
