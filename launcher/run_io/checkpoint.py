"""Atomic checkpoints of one run lineage: write into a temporary dir, fsync, rename, then move the
`latest` pointer.

A reader only ever trusts a directory that holds `meta.json` (written last, inside the temporary
dir), so a crash mid-write leaves the previous checkpoint as the latest complete one; the next save
removes what the dead writer left (the job's lock makes this process the only writer). A *lineage*
is one training history in a checkpoints dir (a fresh start and every resume after it): its id is in
`lineage.json` and in each checkpoint's `meta.json`. `latest` names what this lineage's last
complete save wrote; pruning removes only this lineage's older checkpoints, never the one just
written nor the one `latest` names. A failed write (a full disk) removes its temporary dir and
leaves the previous checkpoint and `latest` as they were.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path

import torch

from dflash_core.files.durable import durable_file, fsync_path, temporary_sibling, write_atomic
from dflash_core.files.readers import UnsafeFileError, load_torch, read_json

log = logging.getLogger("dflash")
_NAME = re.compile(r"^step_(\d{8})$")
# What a writer names a checkpoint, the pointer and the lineage record before the rename that publishes them
# (durable.temporary_sibling): .step_XXXXXXXX.<pid>.tmp, .latest.<pid>.tmp, .lineage.json.<pid>.tmp; and the
# names writers used before (.tmp_step_XXXXXXXX_<pid>, .latest_<pid>, .lineage.json_<pid>), which a run dir
# written by an older version may still hold.
_TEMPORARY = re.compile(r"^\.(?:(?:step_\d{8}|latest|lineage\.json)\.(\d+)\.tmp"
                        r"|(?:tmp_step_\d{8}|latest|lineage\.json)_(\d+))$")
LINEAGE_FILE = "lineage.json"
POINTER = "latest"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the path and the cause."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------- lineage
def read_lineage(root: Path) -> dict | None:
    """{"id", "parent", "started"} of the lineage writing into `root`, or None."""
    path = Path(root) / LINEAGE_FILE
    return read_json(path) if path.is_file() else None


def start_lineage(root: Path, parent: str | None = None, **about) -> str:
    """A new lineage in `root`: a fresh run, or one continuing the checkpoint `parent` of another dir;
    `about` (e.g. which job started it) is recorded with it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lineage = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    write_atomic(root / LINEAGE_FILE, json.dumps({"id": lineage, "parent": parent, "started": time.time(), **about}))
    return lineage


def _lineage_id(root: Path) -> str:
    record = read_lineage(root)
    return record["id"] if record else start_lineage(root)


def read_meta(path: Path) -> dict:
    return read_json(Path(path) / "meta.json")


def complete(root: Path) -> list[Path]:
    """Every complete checkpoint in `root`, whatever its lineage, by step."""
    root = Path(root)
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "meta.json").is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: p.name)


def _belongs(path: Path, lineage: str) -> bool:
    """A checkpoint from before lineages counts as the dir's; so does a torn meta.json (load() reports it)."""
    try:
        return read_meta(path).get("lineage", lineage) == lineage
    except (OSError, ValueError):
        return True


def _members(root: Path, lineage: str) -> list[Path]:
    """This lineage's complete checkpoints by step."""
    return [path for path in complete(root) if _belongs(path, lineage)]


def pointed(root: Path) -> Path | None:
    """The checkpoint `latest` names, when it exists."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


# ----------------------------------------------------------------------------------- writing
def _why(exc: BaseException) -> str:
    """The OS error under `exc` (torch.save wraps it), named by errno, or the exception itself."""
    cause = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return f"{type(exc).__name__}: {exc}"
    name = errno.errorcode.get(cause.errno, "") if cause.errno else ""
    return f"{cause.strerror or cause} ({name})" if name else str(cause.strerror or cause)


def _check_ours(final: Path, lineage: str) -> None:
    if (final / "meta.json").is_file() and not _belongs(final, lineage):
        raise CheckpointWriteError(f"{final} belongs to another run (lineage {read_meta(final).get('lineage')}, "
                                   f"this run is {lineage}): not overwriting it")


def save(root: Path, step: int, state: dict, keep: int, record: dict | None = None) -> Path:
    """`step` is the number of optimiser steps done; the run resumes at that step index. `record`
    (e.g. the config the state was trained with) goes into meta.json."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lineage = _lineage_id(root)
    final = root / f"step_{step:08d}"
    _check_ours(final, lineage)
    tmp = temporary_sibling(final)
    _remove_stale_temporaries(root)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        # Through a Python file object, so a failed write keeps its OSError (errno) as the cause.
        with durable_file(tmp / "state.pt") as file:
            torch.save(state, file)
        meta = {"step": step, "lineage": lineage, "saved": time.time(), **(record or {})}
        with durable_file(tmp / "meta.json") as file:
            file.write(json.dumps(meta).encode())
        fsync_path(tmp)
        if final.exists():   # this lineage re-saving a step (after falling back from a broken one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(root)
        write_atomic(root / POINTER, final.name)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = pointed(root)
        kept = f"latest still names {previous.name}" if previous else "there is no earlier checkpoint"
        raise CheckpointWriteError(f"could not write checkpoint {final}: {_why(exc)}; {kept} and no temporary "
                                   f"files were left (free space there: "
                                   f"{shutil.disk_usage(root).free / 2**30:.1f} GiB)") from exc
    _prune(root, lineage, keep, final)
    return final


def _remove_stale_temporaries(root: Path) -> None:
    """Remove what a writer killed mid-write (SIGKILL, the OOM killer) left behind. The job holds
    run.dir/job.lock, so no other live job writes here, and within the job this process is the only
    writer: a temporary of another pid is a dead writer's."""
    for entry in root.iterdir():
        match = _TEMPORARY.match(entry.name)
        pid = None if match is None else int(match.group(1) or match.group(2))
        if pid is None or pid == os.getpid():
            continue
        log.warning("removing %s: a checkpoint writer (pid %d) died while writing it", entry, pid)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _prune(root: Path, lineage: str, keep: int, written: Path) -> None:
    """Keep this lineage's `keep` newest checkpoints; never the one just written or `latest`'s."""
    protected = {written, pointed(root)}
    older = [p for p in _members(root, lineage) if p not in protected]
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------- reading
def load_latest(root: Path) -> tuple[Path, int, dict] | None:
    """The checkpoint `latest` names, or when it is broken (warned) this lineage's newest one that loads.
    One holding code or objects a checkpoint must not is an UnsafeFileError, not passed over: no save of
    this project writes such a file, so someone else did, and the user decides what to resume from."""
    root = Path(root)
    record = read_lineage(root)
    lineage = record["id"] if record else None
    candidates = list(reversed(_members(root, lineage))) if lineage else list(reversed(complete(root)))
    first = pointed(root)
    if first is not None and first in candidates:
        candidates.remove(first)
        candidates.insert(0, first)
    for path in candidates:
        try:
            return (path, *load(path))
        except UnsafeFileError:
            raise
        except Exception as exc:  # noqa: BLE001 (a torn or corrupt file, whatever torch.load raises: fall back)
            log.warning("checkpoint %s is unreadable (%s: %s); trying the previous one", path, type(exc).__name__, exc)
    return None


def why_incomplete(path: Path) -> str:
    """Why `path` is not a complete checkpoint and what to do ("" when it is one), for an error message."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return ""
    pruned = _NAME.match(path.name) and complete(path.parent)
    if not path.exists():
        return (f"no such directory: {_pruned_by_its_job(path, 'it may have removed this one')}" if pruned
                else "no such directory; pass a run's checkpoints/step_XXXXXXXX directory")
    if pruned:  # saves appear whole (a rename): a step directory without its meta.json is one being removed
        return f"not a complete checkpoint (no meta.json): {_pruned_by_its_job(path, 'it is removing this one')}"
    return "not a complete checkpoint (no meta.json); pass a run's checkpoints/step_XXXXXXXX directory"


def _pruned_by_its_job(path: Path, what: str) -> str:
    newest = complete(path.parent)
    newest = f"; the newest complete one now is {newest[-1].name}" if newest else ""
    return (f"the job writing {path.parent} removes its older checkpoints as it saves new ones "
            f"(it keeps run.keep_checkpoints), and {what}{newest}")


class CheckpointGoneError(FileNotFoundError):
    """A checkpoint removed while it was read: its job pruned it."""


def load(path: Path) -> tuple[int, dict]:
    """(step, state) of the complete checkpoint `path`; one that disappears meanwhile (the running
    job's pruning) is a CheckpointGoneError, an unreadable file a BadFileError naming it, one whose pickle
    asks for more than tensors and plain values an UnsafeFileError (refused unopened)."""
    path = Path(path)
    try:
        meta = read_meta(path)
        # mmap: checking a large checkpoint does not read it all; a torn zip still fails here.
        state = load_torch(path / "state.pt", map_location="cpu", mmap=True)
    except FileNotFoundError as exc:
        if (path / "meta.json").is_file():
            raise  # state.pt alone is missing: not a removal in progress (that takes meta.json too)
        raise CheckpointGoneError(f"checkpoint {path} was removed while being read: "
                                  f"{_pruned_by_its_job(path, 'it removed this one')}") from exc
    if state.get("step") != meta["step"]:
        raise ValueError(f"{path}: state step {state.get('step')} != meta step {meta['step']}")
    return meta["step"], state
