"""Per-process compile isolation: one process publishes its compiled artefacts, another process with
its own cache dir loads them and compiles nothing (an FX-graph cache hit)."""
import os
import subprocess
import sys

from tests.launching import REPO

_PROGRAM = """
import os, sys, torch
from pathlib import Path
os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[2]
from torch._dynamo.utils import counters
from launcher.distributed.isolation import CompileShare
share = CompileShare(Path(sys.argv[1]), {"settings": 1})
loaded = share.load()
torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + x.sin())(torch.randn(64, 64))
if not loaded:
    share.publish()
print(loaded, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


def _compile_in_a_fresh_process(root, cache_dir):
    # VEC_ISA_OK: skip inductor's per-cache-dir compiler probes for every SIMD flavour (~8 s of g++ in each
    # fresh process); only the CPU's own flags are used either way, and the FX-graph cache is what is tested.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    out = subprocess.run([sys.executable, "-c", _PROGRAM, str(root), str(cache_dir)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    loaded, hits, misses = out.stdout.split()
    return loaded == "True", int(hits), int(misses)


def test_published_artefacts_spare_another_process_the_compile(tmp_path):
    assert _compile_in_a_fresh_process(tmp_path, tmp_path / "builder") == (False, 0, 1)
    assert list((tmp_path / "shared").glob("drafter-*.bin"))
    assert _compile_in_a_fresh_process(tmp_path, tmp_path / "other") == (True, 1, 0)
    assert not (tmp_path / "builder").samefile(tmp_path / "other")
