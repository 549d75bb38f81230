"""Durable writes: what is renamed into place must be on disk first."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
