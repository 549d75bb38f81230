"""Helpers for tests that launch real torchrun jobs, or other fresh Python processes, on CPU."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _command(nproc: int, args, module: str | None, torchrun_args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *torchrun_args, *(["-m", module] if module else []), *args]


def _env(env) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **(env or {})}


_INTERPRETER_INT_BUG = "only 0-dimensional arrays can be converted to Python scalars"


def run_in_triton_interpreter(program: str, stdin: str | None = None):
    """Run `program` in a fresh process under TRITON_INTERPRET=1 (Triton reads it when first imported, so
    the kernels run on CPU) and return the JSON value its last output line prints."""
    out = subprocess.run([sys.executable, "-c", program], input=stdin, cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=_env({"TRITON_INTERPRET": "1"}), check=False)
    if out.returncode and _INTERPRETER_INT_BUG in out.stderr and "__index__" in out.stderr:
        import numpy
        import pytest
        import triton
        pytest.skip(f"triton {triton.__version__}'s interpreter converts a kernel's int argument with int() of a "
                    f"1-element array, which numpy {numpy.__version__} refuses (triton 3.9's squeezes it first); "
                    f"on a GPU the gpu-marked tests run these kernels themselves")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def torchrun(nproc: int, *args: str, timeout: float = 300, env=None, module: str | None = "launcher.train",
             torchrun_args=()) -> subprocess.CompletedProcess:
    """The one way tests launch real torchrun jobs: `module` with `args` (overrides), or with
    module=None a script path and its arguments; one OpenMP thread per process (2 shared cores)."""
    return subprocess.run(_command(nproc, args, module, torchrun_args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=_env(env), check=False)


def start_torchrun(nproc: int, *overrides: str, log_path: Path, module: str = "launcher.train",
                   env=None) -> subprocess.Popen:
    """A torchrun job in the background (its own session), its output going to `log_path`; the
    Popen's pid is the torchrun agent's."""
    with open(log_path, "w") as out:
        return subprocess.Popen(_command(nproc, overrides, module, ()), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=_env(env), start_new_session=True)


def worker_pids(run_dir: Path) -> dict[str, int]:
    """{role+rank: pid} from each rank's log ('pid N role R rank K/W ...')."""
    pids = {}
    for log in (run_dir / "logs").glob("*.log"):
        match = re.search(r" pid (\d+) role ", log.read_text())
        if match:
            pids[log.stem] = int(match[1])
    return pids


def wait_for(condition, timeout: float, what: str, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def seq_lines(run_dir: Path, verb: str) -> list[dict]:
    """Parsed lines of the run's seq logs: {"seq", "step", "kind", "index", "drafter", "attempt"}."""
    out = []
    for log in sorted((run_dir / "seq").glob("rank*.log")):
        for line in log.read_text().splitlines():
            words = line.split()
            if words[0] == verb:
                out.append({"seq": int(words[1]), **{k: int(v) for k, v in zip(words[2::2], words[3::2])}})
    return out


def tiny_overrides(tmp_path: Path, tiny_target_dir: Path) -> list[str]:
    return [f"target.path={tiny_target_dir}", f"data.cache_dir={tmp_path / 'tok'}", "run.progress=false"]
