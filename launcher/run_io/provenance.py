"""Where a run came from: the command, the overrides, the code version, the library versions, the
hosts and the rank layout. Written once per run (provenance.json) and copied into the export's card."""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _launcher_command() -> str | None:
    """The parent's command line (torchrun's, when a worker asks), where /proc tells."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return shlex.join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def code_version() -> dict:
    """The git commit and whether the tree differs from it, in a checkout; the package version otherwise."""
    try:
        version = importlib.metadata.version("dflash-launcher")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True,
                                  timeout=10).stdout.strip()
        return {"package": version, "git_commit": git("rev-parse", "HEAD"),
                "git_dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"package": version}


def library_versions() -> dict:
    import torch
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "nccl": None}
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for name in ("transformers", "hydra-core", "omegaconf", "safetensors", "tokenizers", "flash-attn-4",
                 "nvidia-cutlass-dsl"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def this_rank(rank: int, role: str, device, gpu: str | None) -> dict:
    """One rank's line of the layout (gathered over the control group). gpu: the host's name for the one
    GPU this process sees as its device (launcher/distributed/isolation.py, own_gpu)."""
    return {"rank": rank, "role": role, "host": socket.gethostname(), "pid": os.getpid(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "device": str(device), "gpu": gpu}


def _command() -> str:
    """This process's command line, a module run spelled `-m module` as it was typed."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    entry = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return shlex.join([sys.executable, *entry, *sys.argv[1:]])


def provenance(overrides: list[str], layout: list[dict], init_from: dict | None = None) -> dict:
    """init_from: where the drafter's initial weights came from (Job.start_record(): the export's path and
    the sha256 of its weights, or the target layers copied); None: a random initialisation."""
    return {"command": _command(), "launcher_command": _launcher_command(),
            "overrides": list(overrides), "code": code_version(), "versions": library_versions(),
            "hosts": sorted({r["host"] for r in layout}), "ranks": layout, "init_from": init_from}


def write_provenance(run_dir: Path, record: dict) -> Path:
    path = run_dir / "provenance.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def card_provenance(record: dict) -> dict:
    """The short form the model card shows."""
    code = record["code"]
    return {"code": code.get("git_commit") or code.get("package"), "dirty": code.get("git_dirty"),
            **{k: v for k, v in record["versions"].items() if k in ("torch", "transformers", "cuda")},
            "hosts": len(record["hosts"]), "ranks": len(record["ranks"])}
