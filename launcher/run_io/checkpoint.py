"""Atomic checkpoints: write into a temporary dir, fsync, rename, then move the `latest` pointer.

A reader only ever trusts a directory that holds `meta.json` (written last, inside the
temporary dir), so a crash mid-write leaves the previous checkpoint as the latest complete one.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import torch

log = logging.getLogger("dflash")
_NAME = re.compile(r"^step_(\d{8})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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


def save(root: Path, step: int, state: dict, keep: int) -> Path:
    """`step` is the number of optimiser steps done; the run resumes at that step index."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    _fsync_file(tmp / "state.pt")
    _write_file(tmp / "meta.json", json.dumps({"step": step}).encode())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer_tmp = root / f".latest_{os.getpid()}"
    _write_file(pointer_tmp, final.name.encode())
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    _prune(root, keep)
    return final


def _complete(root: Path) -> list[Path]:
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "meta.json").is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: p.name)


def _prune(root: Path, keep: int) -> None:
    for old in _complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load_latest(root: Path) -> tuple[Path, int, dict] | None:
    """The newest checkpoint that loads; broken ones are skipped with a warning."""
    for path in reversed(_complete(root)):
        try:
            return (path, *load(path))
        except Exception as exc:  # a torn or corrupt file: fall back to the previous checkpoint
            log.warning("checkpoint %s is unreadable (%s: %s); trying the previous one", path, type(exc).__name__, exc)
    return None


def load(path: Path) -> tuple[int, dict]:
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    # mmap: checking a large checkpoint does not read it all; a torn zip still fails here.
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False, mmap=True)
    if state.get("step") != meta["step"]:
        raise ValueError(f"{path}: state step {state.get('step')} != meta step {meta['step']}")
    return meta["step"], state
