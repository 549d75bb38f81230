"""Per-process state that must never be shared: compile caches, threads, device, dynamo limits.

Called in each rank's own process before anything compiles; torch._dynamo config overrides are
per thread since torch 2.12, so they are set here, in the main thread of the worker.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_core.files.durable import atomic_file, write_atomic

# Kernel caches inside a process's cache dir that torch's cache artefacts do not carry (whole, at least).
TRITON_CACHE, FLASH_CACHE = "triton", "flash_attn"   # every Triton kernel; flash-attn-4's CuTe kernels
# Extract regular files and directories only, inside the target (Python >= 3.12 filters; older ones trust
# the archive, which only this job's own builder writes).
_DATA_ONLY = {"filter": "data"} if sys.version_info >= (3, 12) else {}


@dataclass
class Isolation:
    pid: int
    cache_dir: Path
    threads: int
    compile_threads: int
    device: torch.device


def own_gpu(local_rank: int, device_setting: str) -> tuple[str | None, int]:
    """Make this process see one GPU, its own, as cuda:0 -> (that GPU as the host names it, how many GPUs
    the host offered this job). (None, 0) with no GPU or on `run.device=cpu`.

    Why: inductor's cache keys name the device index, so a graph compiled on cuda:3 misses on cuda:5.
    With every process on cuda:0 the artefacts one drafter publishes hit on every GPU of the node, and on
    the GPUs of later runs. NCCL finds its peers by bus id, not by index. Ranks share GPUs round-robin
    when there are fewer GPUs than ranks. It must run before anything in the process initialises CUDA
    (`check_own_gpu` says so when something did); counting GPUs through NVML does not."""
    if device_setting == "cpu":
        return None, 0
    count = torch.cuda.device_count()
    if count == 0:
        return None, 0
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = given.split(",")[:count] if given else [str(index) for index in range(count)]
    gpu = entries[local_rank % count].strip()
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu, count


def check_own_gpu(gpu: str) -> None:
    """After CUDA started: this process must see only its own GPU, or every rank would run on one."""
    seen = torch._C._cuda_getDeviceCount()
    if seen != 1:
        raise RuntimeError(f"this process sees {seen} GPUs where it should see only its own ({gpu}): CUDA was "
                           f"initialised before the launcher set CUDA_VISIBLE_DEVICES={gpu}")


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
    # Every Triton kernel's cache, inductor's and the hand-written ones' (dflash_core's AdamW and head
    # loss, which would otherwise share ~/.triton with every process of the host).
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / TRITON_CACHE)
    # flash-attn-4 (the "flash" attention backend) compiles its CuTe kernels in every process unless
    # its persistent cache is on; it reads these when flex first imports it, after this.
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = str(cache_dir / FLASH_CACHE)

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
    """Compiled artefacts that one drafter per node builds and publishes, which the node's other
    drafters, and later runs with the same compile settings, load into their OWN cache dirs before they
    compile: torch.compiler's cache artefacts (graphs, AOT code, inductor's Triton kernels) as one file,
    and the kernel caches those leave out (hand-written Triton kernels, flash-attn-4's) as a tar beside it.
    Every process sees its GPU as cuda:0 (`own_gpu`), so every graph is found on every GPU of the node.
    No two processes ever write one cache: the files are written atomically by their builder, the
    torch file last (its presence says both are complete), and only read by the others."""

    def __init__(self, cache_dir: Path, key: dict):
        """cache_dir: this process's own cache dir (`isolate`); the share lies beside it."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = Path(cache_dir).parent / "shared" / f"drafter-{digest}.bin"
        self.kernels_path = self.path.with_suffix(".kernels.tar")
        self.cache_dir = Path(cache_dir)

    def load(self) -> bool:
        """Load the published artefacts into this process's caches; False when there are none."""
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return False
        if blob:   # empty: the builder had nothing to share (caching off); nothing to wait for either
            torch.compiler.load_cache_artifacts(blob)
        if self.kernels_path.exists():
            with tarfile.open(self.kernels_path) as archive:
                archive.extractall(self.cache_dir, **_DATA_ONLY)
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
        caches = [name for name in (TRITON_CACHE, FLASH_CACHE) if (self.cache_dir / name).is_dir()]
        if caches:
            with atomic_file(self.kernels_path) as file, tarfile.open(fileobj=file, mode="w") as archive:
                for name in caches:
                    archive.add(self.cache_dir / name, arcname=name)
        write_atomic(self.path, saved[0] if saved is not None else b"")
        return self.path


def source_digest(*packages: Path) -> str:
    """A hash of the Python sources that decide what gets compiled (stale artefacts would load but
    miss, silently costing a cold compile)."""
    digest = hashlib.sha256()
    for package in packages:
        for file in sorted(Path(package).rglob("*.py")):
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]
