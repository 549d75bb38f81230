"""Durable writes: what is renamed into place must be on disk first.

`atomic_file` / `write_atomic` replace a whole file: a reader, and a crash at any point, sees the old
file or the new one, never a torn one. The new content goes to a temporary sibling named by
`temporary_sibling` (`.<name>.<pid>.tmp`: the pid tells a dead writer's leftover from a live one's),
is fsynced, renamed onto the path, and the directory is fsynced so the rename survives a power loss.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_sibling(path: Path, pid: int | None = None) -> Path:
    """Where this process (or the process `pid`, when several processes write into one directory that it
    publishes) writes `path` (a file or a directory) before renaming it into place: in the same
    directory, so the rename is atomic. One writer of a path per process."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid() if pid is None else pid}.tmp")


@contextlib.contextmanager
def durable_file(path: Path, mode: str = "wb", **open_args) -> Iterator[IO]:
    """`open(path, mode)` whose content is fsynced when the block ends without an error."""
    with open(path, mode, **open_args) as file:
        yield file
        file.flush()
        os.fsync(file.fileno())


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb", *, permissions: int | None = None, **open_args) -> Iterator[IO]:
    """A file open for writing (`mode` "w" or "wb") that replaces `path` whole when the block ends;
    `permissions` (e.g. 0o644 for files other users serve) instead of what the umask leaves. An error
    in the block leaves `path` as it was and removes the temporary file."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file writes a whole file: mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        with durable_file(tmp, mode, **open_args) as file:
            yield file
        if permissions is not None:
            os.chmod(tmp, permissions)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


def write_atomic(path: Path, data: bytes | str, *, permissions: int | None = None) -> None:
    """Replace `path` whole with `data` (text as UTF-8); see `atomic_file`."""
    with atomic_file(path, "wb", permissions=permissions) as file:
        file.write(data.encode() if isinstance(data, str) else data)


def write_jsonl(path: Path, records: Iterable[dict]) -> int:
    """Replace `path` whole with one JSON line per record (UTF-8, not ASCII-escaped), creating its
    directory; returns the record count. See `atomic_file`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with atomic_file(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count
