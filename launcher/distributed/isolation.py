"""Per-process state that must never be shared: compile caches, threads, device, dynamo limits.

Called in each rank's own process before anything compiles; torch._dynamo config overrides are
per thread since torch 2.12, so they are set here, in the main thread of the worker.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Isolation:
    pid: int
    cache_dir: Path
    threads: int
    compile_threads: int
    device: torch.device


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def isolate(role: str, rank: int, local_world: int, cache_root: Path, device: torch.device,
            recompile_limit: int, compile_threads: int | str) -> Isolation:
    cache_dir = Path(cache_root).resolve() / f"{role}{rank}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    # Triton nests its cache under inductor's when TRITON_CACHE_DIR is unset.
    os.environ.pop("TRITON_CACHE_DIR", None)

    threads = max(1, _usable_cores() // max(1, local_world))
    torch.set_num_threads(threads)
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = threads if compile_threads == "auto" else int(compile_threads)
    dynamo_config.recompile_limit = recompile_limit
    dynamo_config.accumulated_recompile_limit = max(recompile_limit, dynamo_config.accumulated_recompile_limit)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Isolation(os.getpid(), cache_dir, threads, inductor_config.compile_threads, device)


class CompileShare:
    """Compiled artefacts (torch.compiler's cache artefacts: graphs, AOT code, Triton kernels) that one
    drafter per node builds and publishes as one file, which the node's other drafters, and later
    runs with the same compile settings, load into their OWN cache dirs before they compile. On the
    builder's GPU index every graph is found; inductor's graph keys include the device index, so on
    another index the graphs are lowered again but the Triton kernels, the slow part of a cold
    compile, are found. No two processes ever write one cache: the file is written atomically by
    its builder and only read by the others."""

    def __init__(self, cache_root: Path, key: dict):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = Path(cache_root) / "shared" / f"drafter-{digest}.bin"

    def load(self) -> bool:
        """Load the published artefacts into this process's caches; False when there are none."""
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return False
        if blob:   # empty: the builder had nothing to share (caching off); nothing to wait for either
            torch.compiler.load_cache_artifacts(blob)
        return True

    def wait_and_load(self, timeout_s: float, poll_s: float = 0.5) -> bool:
        """A non-builder waits for the builder's file (bounded by the start-up timeout)."""
        deadline = time.monotonic() + timeout_s
        while not self.load():
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    def publish(self) -> Path:
        """Write what this process compiled since it started (the builder, after its warm-up)."""
        saved = torch.compiler.save_cache_artifacts()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(saved[0] if saved is not None else b"")
        os.replace(tmp, self.path)
        return self.path


def source_digest(*packages: Path) -> str:
    """A hash of the Python sources that decide what gets compiled (stale artefacts would load but
    miss, silently costing a cold compile)."""
    digest = hashlib.sha256()
    for package in packages:
        for file in sorted(Path(package).rglob("*.py")):
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]
