"""Helpers for tests that launch real torchrun jobs on CPU."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, *overrides: str, timeout: float = 300, env=None, module: str = "launcher.train",
             torchrun_args=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *torchrun_args, "-m", module, *overrides]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def seq_lines(run_dir: Path, verb: str) -> list[dict]:
    """Parsed lines of the run's seq logs: {"seq", "step", "kind", "drafter", "attempt"}."""
    out = []
    for log in sorted((run_dir / "seq").glob("rank*.log")):
        for line in log.read_text().splitlines():
            words = line.split()
            if words[0] == verb:
                out.append({"seq": int(words[1]), **{k: int(v) for k, v in zip(words[2::2], words[3::2])}})
    return out


def tiny_overrides(tmp_path: Path, tiny_target_dir: Path) -> list[str]:
    return [f"target.path={tiny_target_dir}", f"data.cache_dir={tmp_path / 'tok'}", "run.progress=false"]
