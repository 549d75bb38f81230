"""The run directory (decided once per job), per-rank logging, and the per-rank log of the micro-batches sent."""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("dflash")


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def prepare_run_dir(path: str | Path) -> Path:
    """Create the run dir and prove it is writable; raises OSError naming the path."""
    path = Path(path).resolve()
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise OSError(f"run.dir={str(path)!r} is not writable: {exc.strerror or exc}") from exc
    return path


def setup_logging(tag: str, console_level: int, log_file: Path | None = None) -> None:
    """Every line carries the role and rank; the console shows `console_level` and up."""
    fmt = logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(message)s", "%H:%M:%S")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    console.setLevel(console_level)
    log.addHandler(console)
    if log_file is not None:
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(fmt)
        log.addHandler(file_handler)


class SeqLog:
    """One line per micro-batch a rank sent, trained or evaluated, tagged with torchrun's attempt,
    so tests and people can check that each item was consumed exactly once."""

    def __init__(self, run_dir: Path, rank: int):
        (run_dir / "seq").mkdir(exist_ok=True)
        self._file = open(run_dir / "seq" / f"rank{rank}.log", "a", buffering=1)
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def write(self, verb: str, item) -> None:
        self._file.write(f"{verb} {item.seq} step {item.step} kind {item.kind} index {item.index} "
                         f"drafter {item.drafter} attempt {self._attempt}\n")

    def close(self) -> None:
        self._file.close()
