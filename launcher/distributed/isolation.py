"""Per-process state that must never be shared: compile caches, threads, device, dynamo limits.

Called in each rank's own process before anything compiles; torch._dynamo config overrides are
per thread since torch 2.12, so they are set here, in the main thread of the worker.
"""
from __future__ import annotations

import os
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
