"""Helpers for tests that launch real torchrun jobs on CPU."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, *args: str, timeout: float = 300, env=None, module: str | None = "launcher.train",
             torchrun_args=()) -> subprocess.CompletedProcess:
    """The one way tests launch real torchrun jobs: `module` with `args` (overrides), or with
    module=None a script path and its arguments; one OpenMP thread per process (2 shared cores)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *torchrun_args, *(["-m", module] if module else []), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env, check=False)


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
